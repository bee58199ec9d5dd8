"""The SD3.5-medium GPU trainer config validates here; the tiny SD3 config is the same recipe
(only sizes, hardware layout, prompts and the graph differ) and trains through the CLI
(`python -m trainer --config configs/train_sd3_tiny.yaml --set graph.rollout.weights_path=...`)
against the tiny SD3 checkpoint served by a real graph."""
from __future__ import annotations

import json

import pytest
import torch

from contract import Algorithm, ConfigError, PolicyKind, SamplerKind
from trainer.__main__ import main, parse_overrides
from trainer.config import REPO_ROOT, load_trainer_config
from trainer.learner_config import Placement

pytestmark = pytest.mark.timeout(900)

GPU, TINY = "configs/train_sd35_gpu.yaml", "configs/train_sd3_tiny.yaml"
# what may differ between the two: sizes, the hardware layout, prompts, the graph, bookkeeping
LAYOUT = ("graph", "data.", "steps", "prompts_per_step", "samples_per_prompt", "sampler.num_steps",
          "sampler.height", "sampler.width", "nft.train_timesteps", "learner.device",
          "learner.dtype", "learner.workers", "learner.resources_per_worker", "eval.", "wandb.",
          "run_dir")


def _flat(data):
    """A config's fields as 'section.field' (sections one level deep, the graph whole)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "graph":
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def test_the_sd35_gpu_config_validates_here():
    cfg = load_trainer_config(GPU)
    graph = cfg.graph_config()
    assert graph.rollout.adapter == "sd3" and graph.rollout.dtype == "bfloat16"
    assert {s.name for s in graph.scorers} == {"pickscore", "ocr"}
    assert cfg.algorithm is Algorithm.NFT and cfg.lora.rank == 32
    assert cfg.sampler.sampler is SamplerKind.DPM2 and cfg.sampler.guidance_scale == 1.0
    s = cfg.learner
    assert (s.device, s.dtype, s.workers, s.fine_tune, s.placement) == (
        "cuda", "bfloat16", 2, PolicyKind.LORA, Placement.DISAGGREGATED)
    assert s.gradient_checkpointing and s.micro_batch_size == 4
    assert cfg.prompts_per_step % s.workers == 0 and s.process_group_backend == "nccl"
    for path in (cfg.data.train, cfg.data.test):
        assert (REPO_ROOT / path).is_file()
    if not torch.cuda.is_available():       # on this machine the learner cannot start: typed
        with pytest.raises(ConfigError) as e:
            s.check_device()
        assert e.value.field == "learner.device"
    with pytest.raises(ConfigError) as e:   # a worker count that does not divide 16 groups
        load_trainer_config(GPU, {"learner.workers": 3})
    assert e.value.field == "learner.workers"


def test_the_tiny_config_is_the_gpu_recipe():
    gpu = _flat(load_trainer_config(GPU).model_dump(mode="json"))
    tiny = _flat(load_trainer_config(TINY).model_dump(mode="json"))
    assert set(gpu) == set(tiny)
    differ = {k for k in gpu if gpu[k] != tiny[k]}
    assert differ and all(k.startswith(LAYOUT) for k in differ), sorted(differ)
    for key in ("algorithm", "lora.rank", "optimizer.lr", "nft.beta", "nft.decay",
                "learner.micro_batch_size", "learner.gradient_checkpointing", "sampler.sampler"):
        assert gpu[key] == tiny[key], key


def test_the_tiny_sd3_config_trains_through_the_cli(ray_cluster, tiny_checkpoint, tmp_path):
    from ray import serve

    from graph import build_app, delete_graph
    sets = [f"graph.rollout.weights_path={tiny_checkpoint('sd3')}", "steps=2",
            f"run_dir={tmp_path}", "eval.every=2", "checkpoint_every=2", "gallery=false"]
    graph = load_trainer_config(TINY, parse_overrides(sets)).graph_config()
    serve.run(build_app(graph), name=graph.app_name, route_prefix=None)
    try:
        main(["--config", TINY, *[a for item in sets for a in ("--set", item)]])
    finally:
        delete_graph(graph)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rows"] == 8 and 0.0 <= r["reward_mean"] <= 1.0 for r in steps)
    assert any(r.get("grad_norm", 0.0) > 0 for r in steps)
    checks = next(r for r in rows if any(k.startswith("check_") for k in r))
    assert "check_scheduler_step_max_diff" in checks and "check_lora_probe_max_diff" in checks
    assert "eval_reward_mean" in rows[-1]
