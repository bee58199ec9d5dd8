"""Nothing stays pinned by a failure, in process: when one request of a handle call fails, the
ingress (deployments/ingress.py `RolloutGraph.rollout`) releases every request of the call --
the failed one's partial outputs and the other requests' finished ones, which no caller will
fetch -- and the HTTP face (deployments/http.py) releases a request's outputs whether or not
its answer could be built. The holder is the graph's own ObjectHolder body, called in process."""
from __future__ import annotations

import asyncio
import json
import types

import pytest
from starlette.requests import Request

from contract import NonFiniteOutputError, PromptBundle, RolloutRequest, SamplingSpec, Task
from deployments.ingress import RolloutGraph
from deployments.objects import ObjectHolder


class InProcessHolder:
    """HolderShards' interface over one ObjectHolder body in this process."""

    def __init__(self) -> None:
        self.body = ObjectHolder()
        self.released: list[str] = []

    async def hold(self, request_id, names, refs) -> int:
        return self.body.hold(request_id, names, refs)

    async def release(self, request_ids, names=None) -> int:
        self.released += list(request_ids)
        return self.body.release(list(request_ids), names)

    async def count(self) -> int:
        return self.body.count()


class HoldingStages(RolloutGraph):
    """The real ingress without Serve: each request's stages hold two outputs (its condition
    and its trajectory) before the request finishes; the requests in `fail_ids` then fail."""

    def __init__(self, fail_ids=(), fail_answer: bool = False):
        from adapters.registry import get_family
        from deployments.config import load_graph_config
        from deployments.metrics import StageMetrics
        self.config = load_graph_config({"rollout": {"adapter": "tiny_t2i"},
                                         "limits": {"max_prompts": 8}})
        self.family = get_family(self.config.adapter)
        self.io_spec = self.family.io_spec
        self.scorers, self.scorer_specs, self._prompt_checkers = {}, {}, None
        self.metrics = StageMetrics("ingress")
        self.objects = InProcessHolder()
        self.fail_ids = set(fail_ids)

    async def _one(self, request, requested, media, preview, check_s=0.0):
        rid = request.request_id
        await self.objects.hold(rid, ["condition", "trajectory"], [f"{rid}/c", f"{rid}/t"])
        await asyncio.sleep(0)                     # the other requests run meanwhile
        if rid in self.fail_ids:
            raise NonFiniteOutputError("a non-finite latent", field="rollout", request_id=rid)
        return types.SimpleNamespace(request_id=rid)


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(prompt=PromptBundle(token_ids=(1, 2, 3 + i), text=f"a red circle {i}"),
                           sampling=SamplingSpec(num_steps=2, seeds=(0,)), task=Task.T2I,
                           request_id=f"req-{i}") for i in range(n)]


def test_a_finished_call_leaves_its_outputs_for_the_caller():
    graph = HoldingStages()
    results = asyncio.run(graph.rollout(requests(3)))
    assert [r.request_id for r in results] == ["req-0", "req-1", "req-2"]
    assert asyncio.run(graph.objects.count()) == 6 and graph.objects.released == []


@pytest.mark.parametrize("failing", [["req-0"], ["req-2"], ["req-1", "req-3"]])
def test_a_failed_call_releases_every_request_it_held(failing):
    graph = HoldingStages(fail_ids=failing)
    with pytest.raises(NonFiniteOutputError) as raised:
        asyncio.run(graph.rollout(requests(4)))
    assert raised.value.request_id in failing
    assert sorted(graph.objects.released) == [f"req-{i}" for i in range(4)]
    assert asyncio.run(graph.objects.count()) == 0      # the valid requests' outputs too


def _post(front, body: dict):
    data = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/rollout", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}
    return asyncio.run(front(Request(scope, receive)))


def test_http_releases_the_outputs_when_the_answer_cannot_be_built(monkeypatch):
    import deployments.http as http

    def answer_fails(prompts, results):
        raise RuntimeError("building the answer failed")
    monkeypatch.setattr(http, "_results_response", answer_fails)
    graph = HoldingStages()
    response = _post(graph, {"prompts": ["a red circle", "a blue square"], "num_steps": 2})
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["type"] == "InternalError"
    assert len(graph.objects.released) == 2
    assert asyncio.run(graph.objects.count()) == 0


def test_http_releases_a_failed_calls_outputs():
    graph = HoldingStages()                        # fails whichever request comes second

    async def second_fails(request, requested, media, preview, check_s=0.0):
        rid = request.request_id
        await graph.objects.hold(rid, ["condition"], [f"{rid}/c"])
        if graph.objects.body.count() >= 2:
            raise NonFiniteOutputError("a non-finite latent", field="rollout", request_id=rid)
        return types.SimpleNamespace(request_id=rid)
    graph._one = second_fails
    response = _post(graph, {"prompts": ["a red circle", "a blue square"], "num_steps": 2})
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["type"] == "NonFiniteOutputError"
    assert asyncio.run(graph.objects.count()) == 0 and len(graph.objects.released) == 2


# ---- metadata is strict JSON on every way in (handle API, HTTP, prompt files) ----

@pytest.mark.parametrize("metadata, field", [
    ({"score": float("nan")}, "metadata.score"),
    ({"score": float("inf")}, "metadata.score"),
    ({"n": 2**64}, "metadata.n"),
    ({"include": [{"class": "cat", "count": float("-inf")}]}, "metadata.include[0].count"),
    ({"x": {"y": {"z": {"w": [1]}}}}, "metadata.x.y.z.w"),
    ({"blob": b"bytes"}, "metadata.blob"),
    ({"s": "x" * 1025}, "metadata.s"),
    ({1: "a"}, "metadata"),
])
def test_handle_api_metadata_is_strict_json(metadata, field):
    from contract import RolloutError
    with pytest.raises(RolloutError) as raised:
        RolloutRequest(prompt=PromptBundle(token_ids=(1, 2, 3), text="a cat"),
                       sampling=SamplingSpec(num_steps=2, seeds=(0,)), task=Task.T2I,
                       request_id="meta-1", metadata=metadata)
    assert raised.value.field == field and raised.value.request_id == "meta-1"


def test_geneval_metadata_and_numpy_scalars_pass():
    import numpy as np
    geneval = {"tag": "counting", "include": [{"class": "cat", "count": 2}],
               "exclude": [{"class": "cat", "count": 3}], "prompt": "a photo of two cats"}
    RolloutRequest(prompt=PromptBundle(token_ids=(1, 2, 3), text="two cats"),
                   sampling=SamplingSpec(num_steps=2, seeds=(0,)), task=Task.T2I,
                   metadata={**geneval, "w": np.float32(0.5), "k": np.int64(3)})


def test_metadata_entries_are_bounded():
    from contract import LimitExceededError
    with pytest.raises(LimitExceededError):
        RolloutRequest(prompt=PromptBundle(token_ids=(1, 2, 3), text="a cat"),
                       sampling=SamplingSpec(num_steps=2, seeds=(0,)), task=Task.T2I,
                       metadata={"ids": list(range(300))})


@pytest.mark.parametrize("line", ['{"prompt": "a cat", "metadata": {"w": NaN}}',
                                  '{"prompt": "a cat", "metadata": {"w": 1e400}}',
                                  '{"prompt": "a cat", "metadata": "{\\"w\\": Infinity}"}',
                                  '{"prompt": "a cat", "metadata": {"n": 99999999999999999999}}'])
def test_prompt_file_metadata_is_strict_json(tmp_path, line):
    from contract import DatasetError
    from trainer.datasets import load_prompt_file
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError) as raised:
        load_prompt_file(path)
    assert str(path) in raised.value.field and "metadata" in raised.value.field
