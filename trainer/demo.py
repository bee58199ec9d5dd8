"""`make demo` / `python -m trainer.demo [--config configs/train_tiny_t2va.yaml] [--steps N]`

From a fresh clone: starts a local Ray cluster on loopback (dashboard on 127.0.0.1), deploys the
trainer config's rollout graph, checks it (start-up checks), trains (DiffusionNFT on the verifiable
reward by default), evaluates a held-out verifier reward along the run, prints where the curve,
the gallery and the dashboard are, and shuts down.
Measure reported: mean held-out reward of the last 10 evaluations minus that of the first 10.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from trainer.config import REPO_ROOT, TrainerConfig, load_trainer_config

RAY_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "RAY_DEDUP_LOGS": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graph_with_local_models(cfg: TrainerConfig):
    """The graph config with repo-relative scorer model dirs made absolute; a missing one is a
    ConfigError naming the scorer's field (the tiny CLAP snapshot of the t2va configs is written
    by `python -m testing.snapshots clap DIR`)."""
    from contract import ConfigError
    from deployments.config import GraphConfig
    graph = cfg.graph_config()
    data = graph.model_dump(mode="json")
    for i, spec in enumerate(data.get("scorers", [])):
        params = spec.get("scorer", {}).get("params", {})
        if "model_dir" in params and not Path(params["model_dir"]).is_absolute():
            path = REPO_ROOT / params["model_dir"]
            if not path.exists():
                raise ConfigError(
                    f"scorer {spec['name']!r} reads a model directory that is not there (the "
                    f"tiny CLAP one: python -m testing.snapshots clap {params['model_dir']})",
                    field=f"scorers[{i}].scorer.params.model_dir", expected="a model directory",
                    actual=str(path))
            params["model_dir"] = str(path)
    return GraphConfig.model_validate(data)


@contextmanager
def local_cluster(cfg: TrainerConfig, num_cpus: int = 8) -> Iterator[dict]:
    """Local Ray on loopback + Serve + the graph; torn down on exit."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve
    from graph import build_app
    graph = _graph_with_local_models(cfg)
    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=True,
                   dashboard_host="127.0.0.1", log_to_driver=False,
                   object_store_memory=512 * 2**20, namespace="omni-demo")
    try:
        http_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(graph), name=graph.app_name, route_prefix=None)
        dashboard = getattr(ctx, "dashboard_url", None)
        yield {"dashboard_url": f"http://{dashboard}" if dashboard else None,
               "http_port": http_port, "graph": graph}
    finally:
        try:
            serve.delete(graph.app_name)
            serve.shutdown()
        finally:
            ray.shutdown()


def summarize(run_dir: Path, window: int = 10) -> dict:
    from trainer.logs import read_metrics
    evals = [r["eval_reward_mean"] for r in read_metrics(run_dir) if "eval_reward_mean" in r]
    n = min(window, len(evals) // 2) if len(evals) >= 2 else 0
    if n == 0:
        return {"evaluations": len(evals)}
    first, last = sum(evals[:n]) / n, sum(evals[-n:]) / n
    return {"evaluations": len(evals), "window": n, "heldout_first_mean": first,
            "heldout_last_mean": last, "heldout_gain": last - first, "target_gain": 0.15,
            "heldout_at_start": evals[0], "heldout_at_end": evals[-1]}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m trainer.demo")
    parser.add_argument("--config", default="configs/train_tiny_t2i.yaml")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("run_dir", args.run_dir)) if v}
    cfg = load_trainer_config(args.config, overrides)
    from trainer.loop import Trainer
    with local_cluster(cfg) as info:
        print(f"Ray dashboard: {info['dashboard_url']}", flush=True)
        trainer = Trainer(cfg, progress=True)
        trainer.run()
        summary = summarize(Path(cfg.run_dir))
        run_dir = Path(cfg.run_dir).resolve()
        summary.update(reward_curve=str(run_dir / "reward_curve.png"),
                       gallery=str(run_dir / "gallery"), metrics=str(run_dir / "metrics.jsonl"),
                       tensorboard=str(run_dir / "tensorboard"),
                       dashboard=info["dashboard_url"])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2), flush=True)
    return summary


if __name__ == "__main__":
    main()
