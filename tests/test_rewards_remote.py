"""Remote scorer against real local HTTP servers: the project's reward server running the real
OCR scorer, and servers that fail the ways remote servers do (500, timeouts, malformed JSON)."""
from __future__ import annotations

import asyncio
import base64
import io
import time

import numpy as np
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from contract import ArtifactSpec, MediaArtifact, ScorerFailedError, ScoreStatus
from contract.errors import RemoteScorerError
from rewards.base import ScoreRequest
from rewards.combine import RewardConfig, ScorerWeight, run_scorers
from rewards.registry import ScorerSpec, build_scorer
from testing.http_servers import serve
from tests.test_rewards_ocr import batch as text_images
from tests.test_rewards_ocr import meta

AUDIO = ArtifactSpec("audio", "audio", "decoded", "CT", source="audio_latent", sample_rate=16000)
VIDEO = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent", fps=8.0)
FAST = {"timeout_s": 0.5, "retries": 2, "backoff_s": 0.05, "max_backoff_s": 0.1}


def remote(url, **kw):
    params = {"url": url, "primary": kw.pop("primary", "ocr"), "retry": kw.pop("retry", FAST)}
    return build_scorer(ScorerSpec(kind="remote", params=params | kw))


@pytest.fixture(scope="module")
def ocr_server():
    from rewards.reward_server import build_app
    local = build_scorer(ScorerSpec(kind="ocr"))
    with serve(build_app(local)) as url:
        yield url, local


def test_remote_ocr_equals_local_and_chunks_concurrently(ocr_server):
    url, local = ocr_server
    arts = text_images("OPEN", "HELLO WORLD", "Cat")
    request = ScoreRequest(arts, ("a", "b", "c"),
                           tuple(dict(m, seed=i, first_frame=torch.zeros(3)) for i, m in
                                 enumerate(meta("OPEN", "hello world", "dog"))))
    scorer = remote(f"{url}/score", max_batch=2, retry=dict(FAST, timeout_s=60))
    out = scorer.score(request)
    want = local.score(request)
    assert out.scores["ocr"] == want.scores["ocr"] and out.status == want.status
    assert out.metadata["http_requests"] == 2 and scorer.attempts == 2   # 2 + 1 samples
    assert out.scores["ocr"][0] > 0.9 and out.scores["ocr"][2] < 0.3
    # the server refuses a request without the target text: a 4xx, not retried
    with pytest.raises(RemoteScorerError) as e:
        scorer.score(ScoreRequest(arts, ("a", "b", "c")))
    assert "HTTP 422" in e.value.message and "ocr_text" in e.value.message   # the client's input


def test_media_round_trip_is_exact():
    """PNG and float WAV carry decoded media exactly (what the server scores is what we had)."""
    from rewards.remote_protocol import ScoreBody, decode_body, encode_artifact
    g = torch.Generator().manual_seed(0)
    video = MediaArtifact(VIDEO, torch.randint(0, 256, (2, 3, 3, 8, 12), generator=g,
                                               dtype=torch.uint8))
    audio = MediaArtifact(AUDIO, torch.randn(2, 2, 800, generator=g) * 0.3)
    body = ScoreBody.model_validate({"prompts": ["a", "b"], "media": {
        "video": encode_artifact(video), "audio": encode_artifact(audio)}})
    arts, n = decode_body(body)
    assert n == 2 and torch.equal(arts["video"].data, video.data) and arts["video"].fps == 8.0
    assert torch.equal(arts["audio"].data, audio.data) and arts["audio"].sample_rate == 16000


class Misbehaving:
    """Answers each route the way broken reward servers do; counts the calls it got."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0

    def app(self):
        async def handler(request: Request):
            route = request.url.path.strip("/")
            self.calls[route] = self.calls.get(route, 0) + 1
            body = await request.json()
            n = len(body["prompts"])
            if route == "error500":
                return JSONResponse({"error": "boom"}, status_code=500)
            if route == "flaky" and self.calls[route] <= 2:
                return JSONResponse({"error": "warming up"}, status_code=503)
            if route == "slow":
                await asyncio.sleep(2.0)
            if route == "malformed":
                return Response("{'scores': [0.5,", media_type="application/json")
            if route == "short":
                return JSONResponse({"scores": {"v": [0.5] * (n - 1)}})
            if route == "nan":
                return Response('{"scores": {"v": [NaN' + ', 0.5' * (n - 1) + ']}}',
                                media_type="application/json")
            if route == "partial":
                return JSONResponse({"scores": {"v": [0.25] + [None] * (n - 1)},
                                     "status": ["ok"] + ["failed"] * (n - 1),
                                     "reasons": [None] + ["no face found"] * (n - 1)})
            if route == "concurrency":
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                await asyncio.sleep(0.2)
                self.in_flight -= 1
            # the image's mean pixel / 255, so the answer depends on what was sent
            from PIL import Image
            vals = [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(x)))).mean() / 255)
                    for x in body["media"]["image"]["items"]]
            return JSONResponse({"scores": {"v": vals}})
        return Starlette(routes=[Route("/{route}", handler, methods=["POST"])])


@pytest.fixture(scope="module")
def bad_server():
    srv = Misbehaving()
    with serve(srv.app()) as url:
        yield url, srv


def _images(n=2):
    spec = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
    data = torch.stack([torch.full((3, 8, 8), 30 * (i + 1), dtype=torch.uint8) for i in range(n)])
    return ScoreRequest({"image": MediaArtifact(spec, data)}, ("p",) * n)


def test_failures_are_typed_after_retries(bad_server):
    url, srv = bad_server
    for route, text in (("error500", "HTTP 500"), ("slow", "timed out after 0.5 s")):
        scorer = remote(f"{url}/{route}", primary="v")
        t0 = time.monotonic()
        with pytest.raises(RemoteScorerError) as e:
            scorer.score(_images())
        assert text in e.value.message and "after 3 attempts" in e.value.message
        assert scorer.attempts == 3 and time.monotonic() - t0 >= 0.05 + 0.1  # backoff waited
    for route, text in (("malformed", "malformed JSON"), ("short", "1 values for 2 samples"),
                        ("nan", "NaN is not JSON")):
        scorer = remote(f"{url}/{route}", primary="v")
        with pytest.raises(RemoteScorerError, match=text):
            scorer.score(_images())
        assert scorer.attempts == 1                                         # not retried
    with pytest.raises(RemoteScorerError, match="primary score 'ocr'"):
        remote(f"{url}/fine").score(_images())


def test_retry_then_success_and_bounded_concurrency(bad_server):
    url, srv = bad_server
    flaky = remote(f"{url}/flaky", primary="v")
    out = flaky.score(_images())
    assert flaky.attempts == 3 and out.scores["v"] == pytest.approx((30 / 255, 60 / 255))
    limited = remote(f"{url}/concurrency", primary="v", max_batch=1,
                     retry=dict(FAST, max_concurrency=2, timeout_s=5))
    out = limited.score(_images(6))
    assert out.scores["v"] == pytest.approx(tuple(30 * (i + 1) / 255 for i in range(6)))
    assert srv.max_in_flight == 2 and out.metadata["http_requests"] == 6


def test_policy_missing_with_reason_or_required_failure(bad_server):
    url, _ = bad_server
    down = remote(f"{url}/error500", primary="v", name="judge")
    fine = remote(f"{url}/fine", primary="v", name="fine")
    cfg = RewardConfig(scorers={"judge": ScorerWeight(policy="optional"), "fine": ScorerWeight()})
    report = run_scorers([down, fine], _images(), cfg)
    assert report.by_scorer["judge"].status == (ScoreStatus.MISSING,) * 2
    assert "HTTP 500" in report.by_scorer["judge"].reasons[0]
    assert report.total == pytest.approx((30 / 255, 60 / 255))        # never a 0 for "judge"
    with pytest.raises(ScorerFailedError):
        run_scorers([down], _images(), RewardConfig(scorers={"judge": ScorerWeight()}))
    partial = remote(f"{url}/partial", primary="v", name="judge")
    report = run_scorers([partial, fine], _images(), cfg)
    assert report.by_scorer["judge"].status == (ScoreStatus.OK, ScoreStatus.MISSING)
    assert report.by_scorer["judge"].reasons[1] == "no face found"
    assert report.total == pytest.approx(((0.25 + 30 / 255) / 2, 60 / 255))


# ---- groupwise scorers behind the reward server --------------------------------------------
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")


@pytest.fixture(scope="module")
def rank_server(tmp_path_factory):
    """PickScore_Rank (a real HF CLIP checkpoint written by testing/) behind the reward server."""
    from rewards.reward_server import build_app
    from testing import preference_snapshots as ps
    clip_dir = ps.write_hf_clip_dir(tmp_path_factory.mktemp("remote_rank") / "clip")
    local = build_scorer(ScorerSpec(kind="pickscore_rank", params={"model_dir": clip_dir}))
    with serve(build_app(local)) as url:
        yield url, local


def _rank_request(groups, seed=0):
    n = sum(groups)
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    prompts = tuple(p for i, size in enumerate(groups) for p in [f"prompt {i}"] * size)
    return ScoreRequest({"image": MediaArtifact(IMAGE, images)}, prompts, groups=groups)


def test_remote_groupwise_scorer_equals_local_on_the_same_groups(rank_server):
    url, local = rank_server
    spec = ScorerSpec(kind="remote", params={"url": f"{url}/score", "primary": "rank",
                                             "groupwise": True, "max_batch": 4,
                                             "retry": dict(FAST, timeout_s=60)})
    assert spec.groupwise                       # the graph checks group sizes for it too
    scorer = build_scorer(spec)
    for groups, requests in [((2, 2, 3), 2),     # [2, 2] together, [3] alone
                             ((5,), 1),          # a group over max_batch goes whole
                             ((3, 2, 2, 4), 3)]:
        request = _rank_request(groups, seed=len(groups))
        before = scorer.attempts
        out, want = scorer.score(request), local.score(request)
        assert scorer.attempts - before == requests == out.metadata["http_requests"]
        assert out.scores["rank"] == want.scores["rank"], groups          # exact ranks
        assert out.scores["pickscore"] == pytest.approx(want.scores["pickscore"], abs=1e-6)
        assert out.metadata["group_sizes"] == want.metadata["group_sizes"] == list(groups)
        # ranks are within each group (the server saw the groups, not one batch per request)
        start = 0
        for size in groups:
            ranks = sorted(out.scores["rank"][start:start + size])
            assert ranks == pytest.approx([k / size for k in range(size)])
            start += size


def test_remote_groupwise_refuses_split_groups_before_any_call(rank_server):
    from contract.errors import GroupSplitError
    from rewards.remote_protocol import ScoreBody, decode_body, encode_artifact
    url, _ = rank_server
    scorer = remote(f"{url}/score", primary="rank", groupwise=True, artifacts={"image": "image"})
    request = _rank_request((2, 2))
    for groups, field in [((), "remote.groups"), ((2, 1), "remote.groups"),
                          ((3, 1), "remote.groups[1]")]:
        with pytest.raises(GroupSplitError) as e:
            scorer.score(ScoreRequest(request.artifacts, request.prompts, groups=groups))
        assert e.value.field == field
    assert scorer.attempts == 0
    # the server: stated groups must cover its batch; unstated ones reach a groupwise scorer as
    # none, which it refuses (a 4xx: the client's request, not retried)
    art = encode_artifact(request.artifacts["image"])
    for groups, field in [([1, 1], "groups"), ([4, 0], "groups[1]")]:
        with pytest.raises(Exception) as e:
            decode_body(ScoreBody.model_validate({"prompts": list(request.prompts),
                                                  "media": {"image": art}, "groups": groups}))
        assert getattr(e.value, "field", None) == field
    plain = remote(f"{url}/score", primary="rank", artifacts={"image": "image"})
    with pytest.raises(RemoteScorerError) as e:
        plain.score(request)
    assert "HTTP 4" in e.value.message and "groups" in e.value.message
