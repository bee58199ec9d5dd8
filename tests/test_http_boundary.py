"""The ingress's HTTP face in process (deployments/http.py on a real tiny_t2i family and a real
GraphConfig, called as Serve calls it): what a browser could send (a form or text POST, a
rebound Host) and paths that only end like a route are refused before the body is read; key
floods are refused before pydantic builds an error per key; and a fuzz over content types,
hosts, paths, number edges and key floods answers only JSON, every refusal before a rollout."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from starlette.requests import Request

from contract import LimitExceededError, RequestLimits, RolloutError, StageUnavailableError
from contract.http import HTTPRolloutRequest, parse_rollout_body
from deployments.http import HTTPFront
from tests.http_fuzz import CAPTION, REQUESTS, VALID_BODY, HTTPCase, key_flood

ROOT = "/graph"        # the app's route prefix: Serve passes it as the scope's root_path


class GateOnly(HTTPFront):
    """The HTTP face without stages: a request that passes every HTTP check reaches `rollout`,
    which records it and answers 503 (no stage is deployed here)."""

    def __init__(self, config):
        from adapters.registry import get_family
        self.config, self.family = config, get_family(config.adapter)
        self.reached: list = []

    async def rollout(self, requests, preview=False):
        self.reached.append(requests)
        raise StageUnavailableError("no stages in this test", field="stage")

    async def release(self, request_ids) -> int:
        return 0


@pytest.fixture(scope="module")
def front():
    from deployments.config import load_graph_config
    return GateOnly(load_graph_config({"rollout": {"adapter": "tiny_t2i"},
                                       "limits": {"max_prompts": 4}}))


def call(front: GateOnly, case: HTTPCase) -> tuple[int, dict, bool]:
    """(status, JSON answer, whether it reached the rollout) of one request, as Serve's proxy
    hands it to the replica (full path, the prefix as root_path)."""
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in case.headers]
    scope = {"type": "http", "method": case.method, "path": ROOT + case.path,
             "root_path": ROOT, "headers": headers, "query_string": b"", "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive():
        return {"type": "http.request", "body": case.body, "more_body": False}

    before = len(front.reached)
    response = asyncio.run(front(Request(scope, receive)))
    return response.status_code, json.loads(response.body), len(front.reached) > before


def _case(body=VALID_BODY, path="/rollout", method="POST", host="127.0.0.1:8000",
          content_type="application/json") -> HTTPCase:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = [("content-length", str(len(data)))]
    headers += [("host", host)] if host is not None else []
    headers += [("content-type", content_type)] if content_type is not None else []
    return HTTPCase(method, path, tuple(headers), data, served=True)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "127.0.0.1", "localhost:8000", "LOCALHOST",
                                  "[::1]:8000", "[::1]", "localhost."])
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_a_loopback_json_post_passes_every_http_check(front, host, content_type):
    status, answer, reached = call(front, _case(host=host, content_type=content_type))
    assert reached and status == 503 and answer["error"]["field"] == "stage", answer
    [request] = front.reached[-1]
    assert request.prompt.text == CAPTION and request.sampling.num_steps == 2


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json-patch+json", "application/jsonx",
    "application/json; charset=latin-1", "", None])
def test_a_body_a_browser_posts_without_preflight_is_415(front, content_type):
    status, answer, reached = call(front, _case(content_type=content_type))
    assert status == 415 and not reached, answer
    assert answer["error"]["type"] == "UnsupportedMediaTypeError"
    assert answer["error"]["field"] == "content-type"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.0.0.1:8000", "[::2]:8000", "",
                                  None])
def test_a_foreign_host_is_421_before_anything(front, host):
    status, answer, reached = call(front, _case(host=host))
    assert status == 421 and not reached, answer
    assert answer["error"]["type"] == "MisdirectedRequestError"
    assert answer["error"]["field"] == "host"
    status, answer, _ = call(front, _case(path="/healthz", method="GET", host=host))
    assert status == 421, answer                          # health answers only loopback too


def test_the_host_allow_list_is_configured():
    from deployments.config import load_graph_config
    config = load_graph_config({"rollout": {"adapter": "tiny_t2i"},
                                "http": {"allowed_hosts": ["Rollout.internal"]}})
    custom = GateOnly(config)
    assert call(custom, _case(host="rollout.internal:8000"))[0] == 503
    assert call(custom, _case(host="127.0.0.1:8000"))[0] == 421
    from contract import ConfigError
    with pytest.raises(ConfigError):
        load_graph_config({"http": {"allowed_hosts": ["[::1]"]}})


@pytest.mark.parametrize("path, method, status", [
    ("/anything/rollout", "POST", 404), ("/x/healthz", "GET", 404), ("/rollout/", "POST", 404),
    ("/rollouts", "POST", 404), ("/rollout/x", "POST", 404), ("//rollout", "POST", 404),
    ("/", "POST", 404), ("", "POST", 404), ("/ROLLOUT", "POST", 404),
    ("/rollout", "GET", 405), ("/rollout", "PUT", 405), ("/healthz", "POST", 405),
])
def test_only_exact_routes_are_served(front, path, method, status):
    got, answer, reached = call(front, _case(path=path, method=method))
    assert got == status and not reached, answer
    assert answer["error"]["field"] in ("path", "method") and answer["error"]["message"]


def test_healthz_answers(front):
    status, answer, _ = call(front, _case(path="/healthz", method="GET", body=b""))
    assert status == 200 and answer == {"status": "ok", "adapter": "tiny_t2i"}


@pytest.mark.parametrize("where", ["top", "metadata", "nested"])
def test_a_key_flood_is_refused_without_an_error_per_key(front, where):
    """~50k keys (600 KB, under the body bound): one typed refusal, its traced memory within 16x
    the body (an error per key would hold many times the body and block the event loop)."""
    body = key_flood(where, 50_000)
    assert len(body) < RequestLimits().max_body_bytes
    tracemalloc.start()
    try:
        with pytest.raises(RolloutError) as refused:
            parse_rollout_body(body, RequestLimits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    error = refused.value
    assert error.http_status in (413, 422), error
    assert error.field == {"top": "body", "metadata": "metadata[0]", "nested": "sde_window"}[where]
    assert peak < 16 * len(body), (peak, len(body))
    status, answer, reached = call(front, _case(body=body))
    assert status == error.http_status and not reached, answer


def test_parsing_and_tokenizing_run_off_the_event_loop(front, monkeypatch):
    """The body's parse and its prompts' tokenization (work that grows with the body) run in a
    worker thread, not on the event loop every other request of the replica waits on."""
    import deployments.http as http_face
    threads: dict[str, threading.Thread] = {}

    def recorded(name, function):
        def run(*args, **kwargs):
            threads[name] = threading.current_thread()
            return function(*args, **kwargs)
        return run
    monkeypatch.setattr(http_face, "parse_rollout_body",
                        recorded("parse", http_face.parse_rollout_body))
    monkeypatch.setattr(GateOnly, "_from_http", recorded("tokenize", GateOnly._from_http))
    status, answer, reached = call(front, _case())     # asyncio.run: the loop is this thread
    assert reached and set(threads) == {"parse", "tokenize"}, answer
    assert all(t is not threading.current_thread() for t in threads.values()), threads


def test_the_key_cap_is_the_field_count():
    fields = len(HTTPRolloutRequest.model_fields)
    extra = {f"x{i}": 1 for i in range(fields)}
    with pytest.raises(LimitExceededError) as refused:
        parse_rollout_body(json.dumps(VALID_BODY | extra).encode(), RequestLimits())
    assert refused.value.field == "body" and refused.value.expected == f"<= {fields} keys"


def test_http_fuzz_in_process_answers_json_and_refuses_before_any_rollout(front):
    """Content types, hosts, paths, number edges and key floods, mixed with valid requests:
    every answer is JSON with a 2xx, a 4xx error object or the 503 of this stage-less front;
    exactly the requests that pass every HTTP check reach the rollout, and what reaches it is
    within the graph's bounds."""
    limits = front.config.limits
    seen: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(REQUESTS)
    def case(case: HTTPCase):
        status, answer, reached = call(front, case)
        seen[status] = seen.get(status, 0) + 1
        assert 400 <= status < 500 or (status == 503 and reached), (status, answer, case)
        assert answer["error"]["type"] and answer["error"]["message"], answer
        if not case.served:
            assert status in (404, 405, 415, 421) and not reached, (status, answer, case)
        if reached:
            assert case.served, case
            for request in front.reached[-1]:
                sampling = request.sampling
                assert len(sampling.seeds) <= limits.max_samples_per_prompt
                assert sampling.num_steps <= limits.max_steps
                assert 0.0 <= sampling.noise_level <= 2.0
                assert 0.0 <= sampling.guidance_scale <= limits.max_guidance_scale
                assert all(0 <= seed < 2**64 for seed in sampling.seeds)
                for value in request.metadata.values():        # strict JSON numbers only
                    assert not isinstance(value, float) or math.isfinite(value), request.metadata
                    assert not isinstance(value, int) or -2**63 <= value < 2**64

    case()
    print(f"in-process HTTP fuzz statuses: {dict(sorted(seen.items()))}")
    assert seen.get(503, 0) > 0 and seen.get(415, 0) > 0 and seen.get(421, 0) > 0
    assert seen.get(404, 0) > 0
