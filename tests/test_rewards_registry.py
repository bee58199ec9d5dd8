"""build_scorer: explicit kind -> class construction from config."""
from __future__ import annotations

import pytest

from contract import ConfigError
from rewards.base import Scorer
from rewards.registry import ScorerKind, ScorerSpec, build_scorer


def test_builds_clip_and_clap_from_spec(tmp_path):
    from rewards.clap import ClapScorer
    from rewards.clip import ClipScorer
    from testing.snapshots import write_clap_dir, write_clip_dir
    clip = build_scorer(ScorerSpec(kind="clip", params={
        "name": "clip_t2i", "model": write_clip_dir(tmp_path / "clip")}))
    assert isinstance(clip, ClipScorer) and isinstance(clip, Scorer) and clip.name == "clip_t2i"
    clap = build_scorer(ScorerSpec(kind=ScorerKind.CLAP,
                                   params={"model_dir": write_clap_dir(tmp_path / "clap")}))
    assert isinstance(clap, ClapScorer) and clap.required_artifacts == ("audio",)


def test_bad_params_are_config_errors():
    with pytest.raises(ConfigError) as e:
        build_scorer(ScorerSpec(kind="clip", params={"model": "ViT-B-32", "nope": 1}))
    assert e.value.field == "clip.params.nope"
    with pytest.raises(ConfigError) as e:
        build_scorer(ScorerSpec(kind="imagebind", params={"pairs": ["text_video"]}))
    assert e.value.field == "imagebind.params"
    with pytest.raises(ValueError):
        ScorerSpec(kind="no_such_scorer")


@pytest.mark.parametrize("kind", ["image_attributes", "av_sync", "pitch_color",
                                  "condition_frame"])
def test_builds_verifiers(kind):
    scorer = build_scorer(ScorerSpec(kind=kind))
    assert isinstance(scorer, Scorer)
    with pytest.raises(ConfigError) as e:
        build_scorer(ScorerSpec(kind=kind, params={"no_such_arg": 1}))
    assert e.value.field == f"{kind}.params"
