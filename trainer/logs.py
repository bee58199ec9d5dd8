"""Run folder outputs: metrics.jsonl + TensorBoard, checkpoints, the reward curve, the gallery."""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from contract import ConfigError


class WandbRun:
    """A Weights & Biases run beside TensorBoard. Offline mode writes a local run under
    <run_dir>/wandb/offline-run-*/ (no network; `wandb sync` uploads it later); a resumed run
    continues the same run id (kept in <run_dir>/wandb_id)."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str | None,
                 config: Mapping[str, Any], resume: bool):
        import wandb
        id_file = run_dir / "wandb_id"
        run_id = (id_file.read_text().strip() if resume and id_file.is_file()
                  else uuid.uuid4().hex[:8])
        id_file.write_text(run_id)
        self._wandb = wandb
        self.run = wandb.init(project=project, name=name or run_dir.name, id=run_id,
                              dir=str(run_dir), mode=mode, config=dict(config), resume="allow",
                              settings=wandb.Settings(silent=True, console="off",
                                                      x_disable_stats=True))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                     step=step)

    def log_media(self, step: int, images: Sequence[tuple[Path, str]] = (),
                  videos: Sequence[tuple[Path, str]] = ()) -> None:
        """images / videos: (file, caption); videos are MP4s with their audio track."""
        media = {}
        for i, (path, caption) in enumerate(images):
            media[f"gallery/image_{i}"] = self._wandb.Image(str(path), caption=caption)
        for i, (path, caption) in enumerate(videos):
            media[f"gallery/video_{i}"] = self._wandb.Video(str(path), caption=caption,
                                                            format="mp4")
        if media:
            self.run.log(media, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    def __init__(self, run_dir: Path, fresh: bool = True, wandb: WandbRun | None = None):
        """fresh: a new run starts metrics.jsonl empty; a resumed run appends to it.
        wandb: a W&B run that receives the same scalars (and the gallery media)."""
        from torch.utils.tensorboard import SummaryWriter
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if fresh:
            self.path.write_text("")
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = wandb

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(run_dir: Path) -> Path:
    """reward_curve.png: training reward mean (+-std) and held-out reward per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_metrics(run_dir)
    train = [(r["step"], r["reward_mean"], r.get("reward_std", 0.0)) for r in rows
             if "reward_mean" in r]
    held = [(r["step"], r["eval_reward_mean"]) for r in rows if "eval_reward_mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        s, m, sd = zip(*train)
        ax.plot(s, m, label="train reward (rollout policy)")
        ax.fill_between(s, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                        alpha=0.2)
    if held:
        s, m = zip(*held)
        ax.plot(s, m, "o-", label="held-out verifier reward (ODE)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    out = run_dir / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---- checkpoints ------------------------------------------------------------------------------
def save_checkpoint(run_dir: Path, step: int, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                    optimizer: torch.optim.Optimizer | Mapping, state: Mapping[str, Any]) -> Path:
    """checkpoints/step_<k>/: <adapter>.safetensors per adapter, optimizer.pt (an optimizer's
    state dict, or that dict itself), state.json."""
    root = run_dir / "checkpoints" / f"step_{step:06d}"
    root.mkdir(parents=True, exist_ok=True)
    for name, t in tensors.items():
        save_file(dict(t), str(root / f"lora_{name}.safetensors"))
    torch.save(optimizer if isinstance(optimizer, Mapping) else optimizer.state_dict(),
               root / "optimizer.pt")
    (root / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    (run_dir / "checkpoints" / "latest").write_text(root.name)
    return root


def checkpoint_folder(run_dir: Path, name: str) -> Path:
    """The folder the "latest" marker names: `step_<k>` directly under the run's checkpoints
    folder (after symlinks), never a path elsewhere."""
    checkpoints = (run_dir / "checkpoints").resolve()
    name = name.strip()
    root = (checkpoints / name).resolve()
    if re.fullmatch(r"step_[0-9]{6,}", name) is None or root.parent != checkpoints \
            or not root.is_dir():
        raise ConfigError("the checkpoint marker names no checkpoint of this run",
                          field="resume", expected=f"step_<k> under {checkpoints}",
                          actual=name[:100])
    return root


def load_checkpoint(run_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict, dict]:
    """(adapter tensors, optimizer state dict, state) of the latest checkpoint."""
    marker = run_dir / "checkpoints" / "latest"
    if not marker.is_file():
        raise ConfigError("resume requested but the run folder has no checkpoint",
                          field="resume", actual=str(run_dir))
    root = checkpoint_folder(run_dir, marker.read_text(encoding="utf-8", errors="replace")[:256])
    tensors = {p.stem[len("lora_"):]: load_file(str(p)) for p in root.glob("lora_*.safetensors")}
    optimizer = torch.load(root / "optimizer.pt", weights_only=True)
    state = json.loads((root / "state.json").read_text())
    return tensors, optimizer, state
