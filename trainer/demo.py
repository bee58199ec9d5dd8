"""`make demo` / `python -m trainer.demo [--config configs/train_tiny_t2va.yaml] [--steps N]`

From a fresh clone: starts a local Ray cluster on loopback (dashboard on 127.0.0.1), deploys the
trainer config's rollout graph, checks it (start-up checks), trains (DiffusionNFT on the verifiable
reward by default), evaluates a held-out verifier reward along the run, draws demo.png (held-out
reward and attribute curves over the gallery of held-out prompts at fixed seeds, step 0 vs the
end), prints where it, the curve, the gallery and the dashboard are, and shuts down.
Measure reported: mean held-out reward of the last 10 evaluations minus that of the first 10.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
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


def heldout_attributes(run_dir: Path, window: int = 10) -> dict[str, dict[str, float]]:
    """Per scored attribute of the held-out evaluations (`eval_<scorer>/<name>_mean`): its mean
    over the first and the last `window` evaluations, as `summarize` takes the reward's."""
    from trainer.logs import read_metrics
    rows = [r for r in read_metrics(run_dir) if "eval_reward_mean" in r]
    n = min(window, len(rows) // 2)
    out = {}
    for key in sorted({k for r in rows for k in r if k.startswith("eval_") and
                       k.endswith("_mean") and "/" in k}):
        values = [r[key] for r in rows if key in r]
        if n and len(values) == len(rows):
            name = key[len("eval_"):-len("_mean")]
            out[name] = {"first": sum(values[:n]) / n, "last": sum(values[-n:]) / n}
    return out


def plot_demo(run_dir: Path, prompts: Sequence[str], max_prompts: int = 8) -> Path:
    """demo.png: the held-out reward and each scored attribute per evaluation (the windows the
    measure compares shaded), above the gallery of the first `max_prompts` held-out prompts at
    their fixed seeds at step 0 and at the end, each sample captioned with its reward.
    `prompts`: the held-out prompts in evaluation order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from PIL import Image

    from trainer.gallery import captioned_grid
    from trainer.logs import read_metrics
    rows = [r for r in read_metrics(run_dir) if "eval_reward_mean" in r]
    steps = [r["step"] for r in rows]
    keys = sorted({k for r in rows for k in r if k.startswith("eval_") and "/" in k
                   and k.endswith("_mean") and not k.endswith("/total_mean")})
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for key in keys:
        name = key[len("eval_"):-len("_mean")].split("/", 1)[1]
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], lw=1.2, label=name)
    ax.plot(steps, [r["eval_reward_mean"] for r in rows], "k-", lw=2.4,
            label="reward (what the trainer maximises)")
    n = min(10, len(rows) // 2)
    if n:
        ax.axvspan(steps[0], steps[n - 1], color="0.85", zorder=0)
        ax.axvspan(steps[-n], steps[-1], color="0.85", zorder=0)
    summary = summarize(run_dir)
    gain = summary.get("heldout_gain")
    ax.set_title("held-out prompts, fixed seeds, ODE" + (
        f": reward {summary['heldout_first_mean']:.3f} (first {n} evaluations) -> "
        f"{summary['heldout_last_mean']:.3f} (last {n}), gain {gain:+.3f}" if gain is not None
        else ""), fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out score")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", ncol=2)
    fig.tight_layout()
    curves = run_dir / "heldout_curves.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    root = run_dir / "gallery"
    first, last = torch.load(root / "step0.pt"), torch.load(root / "now.pt")
    group = first["images"].shape[0] // len(prompts)
    shown = min(max_prompts, len(prompts))
    half = (shown + 1) // 2
    grids = []                       # two columns of prompts side by side
    for lo, hi in ((0, half), (half, shown)):
        if hi > lo:
            a, b = lo * group, hi * group
            grids.append(captioned_grid(list(prompts[lo:hi]), group,
                                        (first["images"][a:b], first["captions"][a:b]),
                                        (last["images"][a:b], last["captions"][a:b]),
                                        steps[-1]))
    top = Image.open(curves).convert("RGB")
    grid_w = sum(g.width for g in grids)
    width = max(top.width, grid_w)
    out = Image.new("RGB", (width, top.height + max(g.height for g in grids)), (255, 255, 255))
    out.paste(top, ((width - top.width) // 2, 0))
    x = (width - grid_w) // 2
    for g in grids:
        out.paste(g, (x, top.height))
        x += g.width
    path = run_dir / "demo.png"
    out.save(path)
    return path


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m trainer.demo")
    parser.add_argument("--config", default="configs/train_tiny_t2i.yaml")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("run_dir", args.run_dir)) if v}
    t0 = time.monotonic()
    cfg = load_trainer_config(args.config, overrides)
    from trainer.loop import Trainer
    with local_cluster(cfg) as info:
        print(f"Ray dashboard: {info['dashboard_url']}", flush=True)
        trainer = Trainer(cfg, progress=True)
        trainer.run()
        run_dir = Path(cfg.run_dir).resolve()
        summary = summarize(run_dir)
        summary["heldout_attributes"] = heldout_attributes(run_dir)
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        if (run_dir / "gallery" / "now.pt").is_file():
            summary["picture"] = str(plot_demo(run_dir, [b.text or "" for b in
                                                         trainer.eval_prompts]))
        summary.update(reward_curve=str(run_dir / "reward_curve.png"),
                       gallery=str(run_dir / "gallery"), metrics=str(run_dir / "metrics.jsonl"),
                       tensorboard=str(run_dir / "tensorboard"),
                       dashboard=info["dashboard_url"])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2), flush=True)
    return summary


if __name__ == "__main__":
    main()
