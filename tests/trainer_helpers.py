"""Pieces the trainer tests share: the tiny graph a test module deploys on the shared cluster,
its deployment for the module's lifetime, the metrics a run wrote, and a learner batch sampled
on an embedded engine."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator, Sequence

from trainer.config import load_trainer_config

IMAGE_ATTRIBUTES = ({"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                     "inputs": ["image"], "reward": {"policy": "required"}},)


def tiny_graph(app: str, store: str, rollout: dict | None = None,
               scorers: Sequence[dict] = IMAGE_ATTRIBUTES, max_frames: int = 1) -> dict:
    """The graph section of a trainer config: one half-CPU rollout replica of `rollout`
    (default tiny_t2i), `scorers` required, 32x32 limits, its own policy store."""
    return {"app_name": app, "rollout": rollout or {"adapter": "tiny_t2i"},
            "rollout_stage": {"num_cpus": 0.5}, "scorers": [dict(s) for s in scorers],
            "limits": {"max_prompts": 8, "max_samples_per_prompt": 8, "max_steps": 20,
                       "max_height": 32, "max_width": 32, "max_frames": max_frames},
            "policy_store": store}


def serve_graph(graph: dict) -> Iterator:
    """Body of a module-scoped fixture: deploy `graph` (a trainer config's graph section) as
    its app, yield its GraphConfig, delete the app after the module."""
    from ray import serve

    from graph import build_app, delete_graph
    cfg = load_trainer_config({"graph": graph}).graph_config()
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=None)
    yield cfg
    delete_graph(cfg)


def metric_rows(run_dir: Path) -> list[dict]:
    """Every row of the run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
            .splitlines()]


def train_steps(rows: Sequence[dict]) -> list[dict]:
    """The per-step rows (those with a train time) of metric_rows."""
    return [r for r in rows if "train_s" in r]


def checked_steps(run_dir: Path, steps: Sequence[int] = (1, 2)) -> tuple[list[dict], dict]:
    """(step rows, start-up check row) of a run that logged exactly `steps` and whose start-up
    checks passed: the scheduler step within 1e-5, the LoRA probe within 1e-4 and moving the
    output."""
    rows = metric_rows(run_dir)
    out = train_steps(rows)
    assert [r["step"] for r in out] == list(steps)
    checks = next(r for r in rows if "check_scheduler_step_max_diff" in r)
    assert checks["check_scheduler_step_max_diff"] <= 1e-5
    assert checks["check_lora_probe_max_diff"] <= 1e-4 < checks["check_lora_probe_effect"]
    return out, checks


def sampled_batch(learner, engine, prompts, settings, group: int, seed: int, version: str):
    """One request of `group` rows per prompt sampled on the embedded `engine` at `version`
    (the engine is shut down after), each sample rewarded -|mean latent - 0.1| (deterministic,
    varying within a group), built into the learner's training batch."""
    from contract import RewardReport, RolloutOutput
    from rollout.engine_api import EngineRequest
    from trainer.prompts import make_requests
    from trainer.rollout_batch import build_batch
    requests = make_requests(learner.family, prompts, settings, group, seed, version)

    async def go():
        return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                    ("image_latent",), {}, version))
                for r, p in zip(requests, prompts)]
    results = asyncio.run(go())
    asyncio.run(engine.shutdown())
    outputs = [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                             r.sampling.seeds, rewards=RewardReport({}, tuple(
                                 (-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1)
                                  .abs()).tolist()), {}))
               for r, e in zip(requests, results)]
    return build_batch(learner, prompts, outputs, [r.sampling for r in requests])
