"""Multi-reward weighting and the failure policy (optional -> MISSING, required -> error)."""
from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError

from contract import (ArtifactSpec, ConfigError, MediaArtifact, MediaFormatError,
                      OutputContractError, ScorerFailedError, ScorerOutput, ScoreStatus)
from rewards.base import ScoreRequest
from rewards.combine import (RewardCombiner, RewardConfig, combine, run_scorers)

OK, MISSING, FAILED = ScoreStatus.OK, ScoreStatus.MISSING, ScoreStatus.FAILED
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
LATENT = ArtifactSpec("image", "image", "latent", "latent:CHW")


def out(name, values, status=None, reasons=None, key="r"):
    status = status or tuple(OK if v is not None else MISSING for v in values)
    reasons = reasons or tuple(None if s == OK else "boom" for s in status)
    return ScorerOutput(scorer=name, scores={key: tuple(values)}, status=status, reasons=reasons)


def cfg(**scorers):
    return RewardConfig.model_validate({"scorers": scorers})


def test_weighted_total():
    c = cfg(a={"weight": 3.0, "score": "r"}, b={"weight": 1.0, "score": "r"})
    rep = combine({"a": out("a", (1.0, 0.0)), "b": out("b", (0.0, 0.4))}, c)
    assert rep.total == pytest.approx((0.75, 0.1))
    assert rep.weights == {"a": 3.0, "b": 1.0}
    assert rep.by_scorer["a"].status == (OK, OK)


def test_optional_missing_is_excluded_and_renormalised():
    c = cfg(a={"weight": 3.0, "score": "r"},
            b={"weight": 1.0, "score": "r", "policy": "optional"})
    b = out("b", (0.2, None), reasons=(None, "TimeoutError: slow"))
    rep = combine({"a": out("a", (1.0, 0.5)), "b": b}, c)
    assert rep.total == pytest.approx(((3 * 1.0 + 0.2) / 4, 0.5))   # sample 1: only a, weight 3/3
    assert rep.by_scorer["b"].status == (OK, MISSING)
    assert rep.by_scorer["b"].reasons == (None, "TimeoutError: slow")
    assert rep.by_scorer["b"].scores["r"][1] is None                   # never a substituted 0


def test_optional_failed_status_recorded_as_missing():
    c = cfg(a={"score": "r"}, b={"score": "r", "policy": "optional"})
    b = out("b", (None, 0.6), status=(FAILED, OK), reasons=("no face found", None))
    rep = combine({"a": out("a", (0.1, 0.2)), "b": b}, c)
    assert rep.by_scorer["b"].status == (MISSING, OK)
    assert rep.by_scorer["b"].reasons[0] == "no face found"
    assert rep.total == pytest.approx((0.1, 0.4))


def test_required_failure_names_scorer_and_sample():
    c = cfg(a={"score": "r"}, b={"score": "r"})
    b = out("b", (0.3, None, 0.1), status=(OK, FAILED, OK), reasons=(None, "bad audio", None))
    with pytest.raises(ScorerFailedError) as e:
        combine({"a": out("a", (1.0, 1.0, 1.0)), "b": b}, c)
    assert e.value.field == "rewards.b.samples[1]"
    assert "'b'" in e.value.message and "sample 1" in e.value.message


def test_sample_with_no_scorer_present_is_error():
    c = cfg(a={"score": "r", "policy": "optional"}, b={"score": "r", "policy": "optional"})
    with pytest.raises(ScorerFailedError) as e:
        combine({"a": out("a", (0.5, None)), "b": out("b", (0.5, None))}, c)
    assert e.value.field == "rewards.samples[1]"


def test_normalisation_min_max_and_running_z():
    c = cfg(a={"score": "r", "normalization": {"kind": "min_max", "low": -1, "high": 1}})
    assert combine({"a": out("a", (-1.0, 0.0, 3.0))}, c).total == pytest.approx((0.0, 0.5, 1.0))
    z = cfg(a={"score": "r", "normalization": {"kind": "running_z"}})
    with pytest.raises(ConfigError) as e:
        combine({"a": out("a", (1.0, 3.0))}, z)
    assert e.value.field == "rewards.scorers.a.normalization"
    comb = RewardCombiner(z)
    assert comb({"a": out("a", (1.0, 3.0))}).total == pytest.approx((-1.0, 1.0))
    # second batch uses moments over all four values 1,3,3,3: mean 2.5, std sqrt(0.75)
    assert comb({"a": out("a", (3.0, 3.0))}).total == pytest.approx((0.5 / 0.75 ** 0.5,) * 2)
    with pytest.raises(ValidationError, match="low < high"):
        cfg(a={"normalization": {"kind": "min_max", "low": 1, "high": 1}})


def test_contract_checks():
    c = cfg(a={"score": "r"})
    with pytest.raises(OutputContractError):
        combine({}, c)
    with pytest.raises(ConfigError):
        combine({"a": out("a", (1.0,)), "zz": out("zz", (1.0,))}, c)
    bad = ScorerOutput("a", {"r": (0.0, float("nan"))}, (OK, OK), (None, None))
    with pytest.raises(OutputContractError) as e:
        combine({"a": bad}, c)
    assert e.value.field == "rewards.a.scores.r[1]"
    zero_for_missing = ScorerOutput("a", {"r": (0.0,)}, (MISSING,), ("x",))
    with pytest.raises(OutputContractError):
        combine({"a": zero_for_missing}, cfg(a={"score": "r", "policy": "optional"}))
    with pytest.raises(ConfigError) as e:
        combine({"a": out("a", (1.0,), key="other")}, c)
    assert e.value.field == "rewards.scorers.a.score"
    with pytest.raises(ValidationError):
        cfg(a={"weight": 0})


# --- run_scorers with a real scorer and a slow one -------------------------------------------
@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    torch.set_num_threads(1)
    from rewards.clip import ClipScorer, ClipScorerConfig
    from testing.snapshots import write_clip_dir
    return ClipScorer(ClipScorerConfig(model=write_clip_dir(tmp_path_factory.mktemp("clip"))))


class SlowScorer:
    """A scorer that blocks until released (stands in for a hung model server)."""

    name, required_artifacts, primary = "slow", ("image",), "r"

    def __init__(self):
        self.release = threading.Event()

    def score(self, request):
        self.release.wait(30)
        n = len(request.prompts)
        return ScorerOutput(self.name, {"r": (1.0,) * n}, (OK,) * n, (None,) * n)


def _request(spec=IMAGE):
    data = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8) if spec is IMAGE \
        else torch.randn(2, 4, 8, 8)
    return ScoreRequest({"image": MediaArtifact(spec, data)}, ("a cat", "a dog"))


def test_run_scorers_optional_timeout_is_missing(clip):
    slow = SlowScorer()
    c = cfg(clip={"weight": 1.0}, slow={"weight": 5.0, "policy": "optional", "timeout_s": 0.2})
    try:
        rep = run_scorers([clip, slow], _request(), c)
    finally:
        slow.release.set()
    assert rep.by_scorer["slow"].status == (MISSING, MISSING)
    assert rep.by_scorer["slow"].reasons[0] == "timed out after 0.2 s"
    assert rep.total == pytest.approx(rep.by_scorer["clip"].scores["clip_score"])


def test_run_scorers_required_timeout_raises(clip):
    slow = SlowScorer()
    c = cfg(clip={}, slow={"timeout_s": 0.2})
    try:
        with pytest.raises(ScorerFailedError) as e:
            run_scorers([clip, slow], _request(), c)
    finally:
        slow.release.set()
    assert e.value.field == "rewards.slow.samples" and "timed out" in e.value.message


def test_run_scorers_media_error_by_policy(clip):
    with pytest.raises(ScorerFailedError) as e:
        run_scorers([clip], _request(LATENT), cfg(clip={}))
    assert isinstance(e.value.__cause__, MediaFormatError)
    assert e.value.actual == "clip.artifacts.image.representation"
    slow = SlowScorer()
    slow.release.set()
    rep = run_scorers([clip, slow], _request(LATENT),
                      cfg(clip={"policy": "optional"}, slow={}))
    assert rep.by_scorer["clip"].status == (MISSING, MISSING)
    assert rep.by_scorer["clip"].reasons[0].startswith("MediaFormatError")
    assert rep.total == (1.0, 1.0)


def test_run_scorers_names_must_match_config(clip):
    with pytest.raises(ConfigError):
        run_scorers([clip], _request(), cfg(other={}))
