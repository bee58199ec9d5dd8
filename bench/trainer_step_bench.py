"""One training step broken down, on the tiny SD3 checkpoint with 2 Ray Train workers (gloo),
FlowGRPO against a real local graph.

    python -m bench.trainer_step_bench [--steps 3]
-> bench/results/trainer_step.json

Per step (medians over the steps after the first): rollout wait, condition fetch (rank 0 fetching
its shard's conditions from the object store), the learner's update (rank 0: forwards, backward,
old-policy log-probs recomputed or reused), publish. Two runs in the same cluster, the same
seeds: `flow_grpo.old_log_probs: rollout` (reuse) and `recompute`.

The controller's CPU seconds per step (this process's CPU time over `train_on`: the batch, the
plan, the workers' replies, the parity check's dispatch) are measured in both runs, and "before":
on the same rollouts, the controller's own re-encoding of every row's condition, as it did
when it held a CPU learner with every text encoder (`build_batch` with an in-process Learner),
against building the batch with the encoder stage's conditions by reference (`StageConditions`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer.demo import RAY_ENV as LOCAL_CLUSTER_ENV

RESULTS = Path(__file__).parent / "results"
APP = "bench_trainer_step"


def graph_args(weights: Path) -> dict:
    import yaml
    raw = yaml.safe_load(Path("configs/sd3_tiny.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["app_name"] = APP
    args["policy_store"] = f"{APP}_store"
    args["rollout"]["weights_path"] = str(weights)
    return args


def trainer_config(graph: dict, run_dir: Path, steps: int, old_log_probs: str):
    from trainer.config import load_trainer_config
    return load_trainer_config({
        "graph": graph, "algorithm": "flow_grpo", "prompts": "shapes", "steps": steps,
        "prompts_per_step": 2, "samples_per_prompt": 4,
        "sampler": {"sampler": "sde", "num_steps": 4, "noise_level": 0.7, "window": [0, 3],
                    "height": 32, "width": 48},
        "lora": {"rank": 8, "alpha": 16}, "optimizer": {"lr": 1e-4},
        "flow_grpo": {"old_log_probs": old_log_probs},
        "learner": {"workers": 2, "resources_per_worker": {"CPU": 0.5}, "micro_batch_size": 4},
        "pipeline": {"mode": "serial", "max_staleness": 1},
        "eval": {"every": 10_000, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
        "checks": {"time_convention": False, "lora_map": False, "logprob_parity_every": 1},
        "run_dir": str(run_dir), "checkpoint_every": 10_000, "gallery": False})


def run(cfg, measure_before: bool) -> dict:
    from trainer.learner import Learner
    from trainer.loop import Trainer
    from trainer.rollout_batch import StageConditions, build_batch, canonical_media

    class Timed(Trainer):
        def train_on(self, outputs, pending):
            c0 = time.process_time()
            metrics = super().train_on(outputs, pending)
            metrics["controller_cpu_s"] = time.process_time() - c0
            self.kept = (outputs, pending)
            return metrics

    trainer = Timed(cfg)
    history = trainer.run()
    out = {"steps": len(history), "per_step": history}
    if measure_before:
        outputs, pending = trainer.kept
        samplings = [r.sampling for r in pending.requests]
        media = canonical_media(pending.requests)
        encoders = Learner.load(trainer.family, cfg.lora, cfg.optimizer, cfg.seed,
                                cfg.learner.model_copy(update={"workers": 0}))

        def cpu(source) -> float:
            times = []
            for _ in range(3):
                c0 = time.process_time()
                build_batch(source, pending.prompts, outputs, samplings, media)
                times.append(time.process_time() - c0)
            return statistics.median(times)
        out["batch_controller_cpu_s"] = {
            "before_reencode_on_controller": cpu(encoders),
            "after_conditions_by_reference": cpu(StageConditions(trainer.family))}
        from trainer.learner_worker import parameter_bytes
        out["before_controller_model_bytes"] = sum(
            parameter_bytes({**encoders.models, **encoders.encoders}).values())
    return out


def summary(result: dict) -> dict:
    rows = [r for r in result["per_step"] if "train_s" in r][1:] or \
        [r for r in result["per_step"] if "train_s" in r]
    keys = ("rollout_wait_s", "condition_fetch_s", "learner_update_s", "train_s", "sync_s",
            "controller_cpu_s", "step_s", "old_logprob_reused_rows")
    return {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    for key, value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    import ray
    from ray import serve

    from deployments.config import load_graph_config
    from graph import build_app, delete_graph
    from testing.tiny_checkpoints import build
    from trainer.demo import _free_port
    load_before = os.getloadavg()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=512 * 2**20, namespace="omni-bench")
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    report: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            weights = build("sd3", Path(tmp) / "ckpt")
            graph = graph_args(weights)
            serve.run(build_app(load_graph_config(graph)), name=APP, route_prefix=None)
            runs = {}
            for mode in ("rollout", "recompute"):
                cfg = trainer_config(graph, Path(tmp) / mode, args.steps, mode)
                runs[mode] = run(cfg, measure_before=mode == "rollout")
                print(f"[trainer_step] {mode}: {summary(runs[mode])}", flush=True)
            delete_graph(load_graph_config(graph))
        reuse, recompute = summary(runs["rollout"]), summary(runs["recompute"])
        report = {
            "what": "one FlowGRPO step on the tiny SD3 checkpoint (real diffusers layout, "
                    "random weights), 2 prompts x 4 samples, 4 SDE steps (window 0-3), "
                    "2 Ray Train workers (gloo, 0.5 CPU each), serial pipeline; medians over "
                    "the steps after the first",
            "steps": args.steps,
            "reuse (flow_grpo.old_log_probs: rollout)": reuse,
            "recompute (flow_grpo.old_log_probs: recompute)": recompute,
            "learner_update_s_reuse_over_recompute":
                reuse.get("learner_update_s", float("nan")) /
                recompute.get("learner_update_s", float("nan")),
            "controller_cpu_s_per_step": {"reuse": reuse.get("controller_cpu_s"),
                                          "recompute": recompute.get("controller_cpu_s")},
            "batch_controller_cpu_s (before vs after, same rollouts)":
                runs["rollout"]["batch_controller_cpu_s"],
            "before_controller_model_bytes": runs["rollout"]["before_controller_model_bytes"],
            "after_controller_model_bytes": 0,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "loadavg_at_start": load_before, "loadavg_at_end": os.getloadavg(),
                        "note": "a 2-core machine shared with other work (load average "
                                "far above 2): every time is inflated and noisy; compare "
                                "the two runs of this file only"},
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "trainer_step.json").write_text(json.dumps(report, indent=1) + "\n")
    finally:
        serve.shutdown()
        ray.shutdown()
    return report


if __name__ == "__main__":
    main()
