"""The reward configs that ship: the SD3.5 + PickScore + OCR GPU graph validates here (scorer
configs checked without loading weights), the tiny OCR training run's prompts carry targets."""
from __future__ import annotations

import json

import pytest

from deployments.config import load_graph_config
from rewards.registry import ScorerKind, validate_spec


def test_gpu_sd35_pickscore_ocr_validates():
    cfg = load_graph_config("configs/gpu_sd35_pickscore_ocr.yaml")
    assert cfg.adapter == "sd3" and cfg.rollout.device == "cuda"
    kinds = {s.name: s.scorer.kind for s in cfg.scorers}
    assert kinds == {"pickscore": ScorerKind.PICKSCORE, "ocr": ScorerKind.OCR}
    for stage in cfg.scorers:
        params = validate_spec(stage.scorer)
        assert params is not None and stage.inputs == ("image",)
    pick = validate_spec(cfg.scorers[0].scorer)
    assert pick.model_dir == "/models/PickScore_v1" and pick.dtype == "bfloat16"
    opts = cfg.scorers[0].stage.deployment_options("Scorer_pickscore")
    assert opts["ray_actor_options"]["num_gpus"] == 0.25
    assert cfg.reward_config.scorers["ocr"].timeout_s == 300


def test_validate_spec_names_the_bad_field():
    from contract import ConfigError
    from rewards.registry import ScorerSpec
    with pytest.raises(ConfigError) as e:
        validate_spec(ScorerSpec(kind="pickscore", params={"model_dir": "/m", "dtyp": "x"}))
    assert e.value.field == "pickscore.params.dtyp"
    assert validate_spec(ScorerSpec(kind="av_sync")) is None


def test_tiny_ocr_training_config_and_prompts():
    from trainer.config import load_trainer_config
    cfg = load_trainer_config("configs/train_tiny_t2i_ocr.yaml")
    graph = cfg.graph_config()
    assert [s.scorer.kind for s in graph.scorers] == [ScorerKind.OCR]
    key = validate_spec(graph.scorers[0].scorer).target_key
    for path in (cfg.data.train, cfg.data.test):
        rows = [json.loads(line) for line in open(path)]
        assert rows and all(r["metadata"][key] and f'"{r["metadata"][key]}"' in r["prompt"]
                            for r in rows)
