"""Every remote surface bounded. The remote-scorer client against real local servers that answer
the ways a hostile or broken server does (a gzip bomb, a stream past the byte bound, a trickle,
1e400, unbounded / deep / non-finite / lone-surrogate metadata), and the project's reward
server in process against bodies that decode to more than they weigh (many small PNGs, FLAC
silence), bodies past the byte bound, malformed media items, paths and content types -- each a
typed JSON error, with a derandomized fuzz over all of them."""
from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from contract import ArtifactSpec, MediaArtifact
from contract.errors import RemoteScorerError
from rewards.base import ScoreRequest
from rewards.registry import ScorerSpec, build_scorer
from testing.http_servers import serve

CHUNK = 64 * 1024
FAST = {"timeout_s": 60.0, "retries": 0, "max_response_bytes": 1 << 20}
BOMB = gzip.compress(b" " * (64 << 20), 9)       # 64 KB on the wire, 64 MiB inflated


# ---------------------------------------------------------------- the client (rewards/http_client)
class Hostile:
    """Routes answering as a hostile reward server would; counts the bytes it got to send."""

    def __init__(self):
        self.sent: dict[str, int] = {}

    def app(self) -> Starlette:
        async def handler(request: Request):
            route = request.url.path.strip("/")
            n = len((await request.json())["prompts"])
            ok = {"scores": {"v": [0.5] * n}}
            if route == "bomb":
                return Response(BOMB,
                                media_type="application/json",
                                headers={"content-encoding": "gzip"})
            if route == "endless":               # 64 MiB streamed, no Content-Length
                async def chunks():
                    for _ in range(1024):
                        if await request.is_disconnected():      # the client cut it
                            return
                        self.sent[route] = self.sent.get(route, 0) + CHUNK
                        yield b" " * CHUNK
                return StreamingResponse(chunks(), media_type="application/json")
            if route == "trickle":               # one byte every 50 ms, for 60 s
                async def trickle():
                    for _ in range(1200):
                        yield b" "
                        await asyncio.sleep(0.05)
                return StreamingResponse(trickle(), media_type="application/json")
            raw = {"overflow": '{"scores": {"v": [1e400' + ", 0.5" * (n - 1) + "]}}",
                   "meta_inf": json.dumps(ok)[:-1] + ', "metadata": {"x": 1e400}}',
                   "meta_int": json.dumps(ok)[:-1] + ', "metadata": {"x": ' + str(2**70) + "}}",
                   "meta_surrogate": json.dumps(ok)[:-1] + ', "metadata": {"x": "\\ud800"}}',
                   "reason_surrogate": json.dumps({"scores": {"v": [None] * n},
                                                   "status": ["failed"] * n})[:-1]
                   + ', "reasons": [' + ", ".join(['"\\udfff"'] * n) + "]}",
                   "meta_big": json.dumps(ok | {"metadata": {"x": "y" * 10_000}}),
                   "meta_deep": json.dumps(ok | {"metadata": {"a": [[[[{"b": 1}]]]]}}),
                   "fine": json.dumps(ok | {"metadata": {"model": "v1", "n": [1, 2]}}),
                   "fine_gzip": json.dumps(ok)}[route]
            if route == "fine_gzip":
                return Response(gzip.compress(raw.encode()), media_type="application/json",
                                headers={"content-encoding": "gzip"})
            return Response(raw, media_type="application/json")
        return Starlette(routes=[Route("/{route}", handler, methods=["POST"])])


@pytest.fixture(scope="module")
def hostile():
    server = Hostile()
    with serve(server.app()) as url:
        yield url, server


def _remote(url: str, **retry):
    return build_scorer(ScorerSpec(kind="remote", params={
        "url": url, "primary": "v", "retry": FAST | retry}))


def _images(n=2) -> ScoreRequest:
    spec = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
    return ScoreRequest({"image": MediaArtifact(spec, torch.zeros(n, 3, 8, 8, dtype=torch.uint8))},
                        ("p",) * n)


@pytest.mark.parametrize("route, message", [
    ("bomb", "too much (decompressed)"),
    ("overflow", "overflows a float"),
    ("meta_inf", "overflows a float"),
    ("meta_int", "outside 64 bits"),
    ("meta_surrogate", "lone surrogate"),
    ("reason_surrogate", "lone surrogate"),
    ("meta_big", "more than 4096"),
    ("meta_deep", "nested deeper than 4"),
])
def test_an_answer_past_a_bound_is_a_typed_error_not_retried(hostile, route, message):
    url, _ = hostile
    scorer = _remote(f"{url}/{route}", retries=2, backoff_s=0.0)
    with pytest.raises(RemoteScorerError) as refused:
        scorer.score(_images(1))
    assert message in refused.value.message and scorer.attempts == 1, refused.value


def test_a_stream_past_the_byte_bound_is_cut_while_it_arrives(hostile):
    """64 MiB without a Content-Length against a 1 MiB bound: refused, and the server got to
    send only what the sockets buffer beyond the bound (the whole answer was read before)."""
    url, server = hostile
    with pytest.raises(RemoteScorerError, match="too much \\(on the wire\\)"):
        _remote(f"{url}/endless").score(_images())
    assert server.sent["endless"] < 16 << 20, server.sent


def test_a_trickling_server_meets_the_total_deadline(hostile):
    """A byte every 50 ms never trips a per-read timeout; the attempt's total deadline ends it."""
    url, _ = hostile
    scorer = _remote(f"{url}/trickle", timeout_s=0.5)
    with pytest.raises(RemoteScorerError, match="timed out after 0.5 s"):
        scorer.score(_images())


def test_bounded_answers_pass(hostile):
    url, _ = hostile
    out = _remote(f"{url}/fine").score(_images())
    assert out.scores["v"] == (0.5, 0.5) and out.metadata["model"] == "v1"
    assert _remote(f"{url}/fine_gzip").score(_images()).scores["v"] == (0.5, 0.5)


# ---------------------------------------------------------------- the reward server
def _png(width=16, height=16, mode="RGB") -> str:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _audio(frames: int, fmt: str = "WAV") -> str:
    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros((frames, 1), np.float32), 16000, format=fmt,
                    subtype="FLOAT" if fmt == "WAV" else "PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


CAPTION = "a red circle at the top left on a black background"


def _image_body(items, prompt="p") -> dict:
    return {"prompts": [prompt] * len(items),
            "media": {"image": {"modality": "image", "format": "png", "items": items}}}


def _with_image(entry: dict, n: int) -> dict:
    """`entry` first (decoded first), then the image the server's scorer reads."""
    return {"prompts": ["p"] * n, "media": entry | _image_body([_png(8, 8)] * n)["media"]}


def _audio_body(items, fmt="wav") -> dict:
    return _with_image({"audio": {"modality": "audio", "format": fmt, "sample_rate": 16000,
                                  "items": items}}, len(items))


def _video_body(items) -> dict:
    return _with_image({"video": {"modality": "video", "format": "png", "fps": 8.0,
                                  "items": items}}, len(items))


SERVER_BOUNDS = {"max_body_bytes": 1 << 20, "max_pixels": 64 * 64,
                 "max_body_pixels": 8 * 32 * 32, "max_body_samples": 4 * 16000}


@pytest.fixture(scope="module")
def reward_server():
    from starlette.testclient import TestClient

    from rewards.reward_server import build_app
    scorer = build_scorer(ScorerSpec(kind="image_attributes"))
    with TestClient(build_app(scorer, **SERVER_BOUNDS), raise_server_exceptions=False,
                    base_url="http://127.0.0.1") as client:
        yield client


def _post(client, body, content_type="application/json", path="/score"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = client.post(path, content=data, headers={"content-type": content_type})
    return answer.status_code, answer.json()          # every answer is JSON


@pytest.mark.parametrize("body, status, field", [
    # 9 small PNGs of 32x32 each pass the per-image bound; together they pass the body's
    (_image_body([_png(32, 32)] * 9), 413, "media.image.items[8]"),
    (_video_body([[_png(32, 32)] * 3] * 3), 413, "media.video.items[2][2]"),
    (_image_body([_png(65, 64)]), 413, "media.image.items[0]"),           # one image too big
    (_audio_body([_audio(16000)] * 5), 413, "media.audio.items[4]"),       # samples per body
    (_audio_body([_audio(16000, "FLAC")]), 400, "media.audio.items[0]"),   # only WAV decodes
    (_audio_body([_audio(100)], fmt="flac"), 422, "media.audio"),
    (_image_body([_png(mode="I;16")]), 400, "media.image.items[0]"),       # no depth change
    (_image_body([_png(mode="P")]), 400, "media.image.items[0]"),          # nor palette
    (_video_body([7]), 422, "media.video"),                                # not a list
    (_video_body(["abc"]), 422, "media.video"),
    (_image_body([["x"]]), 422, "media.image"),
    (_image_body(["!!notbase64"]), 400, "media.image.items[0]"),
    ({"prompts": ["p"], "metadata": [{"x": float("nan")}], "media": {}}, 400, "body"),
    (b'{"prompts": ["p"], "media": {}, "metadata": [{"x": 1e400}]}', 400, "body"),
    (json.dumps({"prompts": ["p"], "media": {}} | {f"k{i}": 0 for i in range(50_000)}).encode(),
     422, "body"),
    (b"\xff\xfe", 400, "body"),
])
def test_reward_server_refusals_are_typed_json(reward_server, body, status, field):
    got, answer = _post(reward_server, body)
    assert got == status, answer
    assert answer["error"]["field"] == field and answer["error"]["message"], answer


def test_reward_server_refuses_by_size_before_reading_the_body(reward_server):
    big = json.dumps(_image_body(["A" * (2 << 20)])).encode()
    assert _post(reward_server, big)[0] == 413                          # Content-Length
    streamed = reward_server.post("/score", content=iter([big[:CHUNK]] * 40),
                                  headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["field"] == "body"


@pytest.mark.parametrize("content_type, path, method, status", [
    ("text/plain", "/score", "POST", 415),
    ("application/x-www-form-urlencoded", "/score", "POST", 415),
    ("application/json", "/anything", "POST", 404),
    ("application/json", "/score", "GET", 405),
])
def test_reward_server_answers_json_for_paths_and_types(reward_server, content_type, path,
                                                        method, status):
    answer = reward_server.request(method, path, content=json.dumps(_image_body([_png()])),
                                   headers={"content-type": content_type})
    assert answer.status_code == status and answer.json()["error"]["message"], answer.text


def test_reward_server_scores_within_its_bounds(reward_server):
    """Eight 32x32 images use the whole pixel budget of a body and are scored."""
    status, answer = _post(reward_server, _image_body([_png(32, 32)] * 8, prompt=CAPTION))
    assert status == 200, answer
    assert answer["status"] == ["ok"] * 8 and len(answer["scores"]["total"]) == 8


def _fuzz_bodies():
    png, wav = _png(16, 16), _audio(64)
    valid = _image_body([png], prompt=CAPTION)
    junk = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | \
        st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=4),
                                                              st.integers(), max_size=3)
    items = st.lists(st.sampled_from([png, wav, "", "==", 3, [png], [[png]], None, {"a": 1}]),
                     max_size=4)
    entry = st.fixed_dictionaries({"modality": st.sampled_from(["image", "video", "audio", "x"]),
                                   "format": st.sampled_from(["png", "wav", "flac", "jpeg"]),
                                   "items": items | junk},
                                  optional={"fps": junk, "sample_rate": junk})
    body = st.fixed_dictionaries({"prompts": st.lists(st.text(max_size=4), max_size=4) | junk},
                                 optional={"metadata": junk | st.lists(junk, max_size=3),
                                           "media": st.dictionaries(st.sampled_from(["image", "v"]),
                                                                    entry | junk, max_size=2)})
    raw = body.map(lambda b: json.dumps(b, allow_nan=True).encode())
    edges = st.sampled_from(["1e400", "NaN", "-Infinity", str(2**64), "1" + "0" * 30]).map(
        lambda t: (json.dumps(valid)[:-1] + f', "metadata": [{{"x": {t}}}]}}').encode())
    floods = st.sampled_from([20, 5_000, 50_000]).map(
        lambda n: json.dumps(valid | {f"k{i}": 0 for i in range(n)}).encode())
    return raw | edges | floods | st.binary(max_size=64) | st.just(json.dumps(valid).encode())


def test_reward_server_fuzz_answers_json_and_never_500(reward_server):
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_fuzz_bodies(), st.sampled_from(["application/json", "text/plain"]))
    def case(body: bytes, content_type: str):
        status, answer = _post(reward_server, body, content_type)
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (status, answer, body[:200])
        if status != 200:
            assert answer["error"]["type"] and answer["error"]["message"], answer

    case()
    print(f"reward-server fuzz statuses: {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) and seen.get(415, 0) and seen.get(422, 0) and seen.get(400, 0)
