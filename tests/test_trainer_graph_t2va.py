"""The trainer against a real local Ray graph serving tiny_t2va (joint video+audio state, the
data-progress time convention): each algorithm for a short loop on the rule-based AV rewards,
and the time-convention check failing when the flip is removed (declared as noise_level)."""
from __future__ import annotations

import pytest
import torch

from contract import Algorithm, StartupCheckError, TimeConvention
from tests.trainer_helpers import metric_rows, serve_graph, tiny_graph, train_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(900)

APP = "trainer_t2va"
AV_SCORERS = [{"name": name, "scorer": {"kind": name}, "inputs": ["video", "audio"],
               "reward": {"policy": "required"}} for name in ("av_sync", "pitch_color")]


def graph_config():
    return tiny_graph(APP, "trainer_test_store_t2va", rollout={"adapter": "tiny_t2va"},
                      scorers=AV_SCORERS, max_frames=8)


def trainer_config(tmp_path, algorithm: Algorithm, mode: str, **over):
    cfg = {"graph": graph_config(), "algorithm": algorithm.value, "prompts": "clips",
           "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2],
                       "num_frames": 8},
           "lora": {"rank": 4, "alpha": 8}, "nft": {"train_timesteps": 1},
           "dpo": {"draws_per_pair": 1}, "pipeline": {"mode": mode, "max_staleness": 1},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "run_dir": str(tmp_path / algorithm.value), "checkpoint_every": 2, "gallery": True}
    cfg.update(over)
    return load_trainer_config(cfg)


@pytest.fixture(scope="module")
def graph(ray_cluster):
    yield from serve_graph(graph_config())


@pytest.mark.parametrize("algorithm,mode", [(Algorithm.NFT, "async"),
                                            (Algorithm.FLOW_GRPO, "async"),
                                            (Algorithm.DPO, "serial")])
def test_short_loop_t2va(graph, tmp_path, algorithm, mode):
    from trainer.loop import Trainer
    torch.manual_seed(0)
    # the first run does every start-up check; the others skip the (already shown) LoRA probe
    checks = {} if algorithm is Algorithm.NFT else {"lora_map": False, "time_convention": False}
    trainer = Trainer(trainer_config(tmp_path, algorithm, mode, checks=checks))
    before = {k: v.clone() for k, v in trainer.learner.export()[0].items()}
    history = trainer.run()
    run = tmp_path / algorithm.value
    rows = metric_rows(run)
    steps = train_steps(rows)
    assert [r["step"] for r in steps] == [1, 2] and len(history) == 2
    for r in steps:
        assert r["rows"] == 4 and torch.isfinite(torch.tensor(r["reward_mean"]))
        for scorer in ("av_sync", "pitch_color"):          # per-scorer reward statistics
            assert any(k.startswith(f"reward_{scorer}/") and k.endswith("_mean") for k in r)
        assert r["logprob_ratio_err_max"] <= 1e-4            # version parity on the AV state
    if algorithm is Algorithm.NFT:
        checked = next(r for r in rows if "check_lora_probe_max_diff" in r)
        assert checked["check_lora_probe_max_diff"] <= 1e-4
        assert checked["check_cos_declared@0.5"] > checked["check_cos_other@0.5"]
    after = trainer.learner.export()[0]
    assert any(not torch.equal(before[k], after[k]) for k in after)   # the LoRA was trained
    gallery = run / "gallery"
    assert (gallery / "step0_frames.png").is_file() and (gallery / "now_frames.png").is_file()
    assert (gallery / "step0_prompt0.mp4").stat().st_size > 0


def test_flip_removed_fails_t2va(graph, tmp_path, monkeypatch):
    from trainer.loop import Trainer
    trainer = Trainer(trainer_config(tmp_path, Algorithm.NFT, "serial",
                                     checks={"lora_map": False}))
    assert trainer.startup.run()["cos_declared@0.5"] > 0.3
    assert trainer.family.denoiser.time_convention is TimeConvention.DATA_PROGRESS
    monkeypatch.setattr(trainer.family.denoiser, "time_convention", TimeConvention.NOISE_LEVEL)
    with pytest.raises(StartupCheckError) as e:
        trainer.startup.run()
    assert e.value.field == "adapter.time_convention"
