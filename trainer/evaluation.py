"""Evaluation of a training run: held-out prompts sampled with ODE at fixed seeds through the
graph with the evaluated policy version (the trainer names it: the EMA of the trained adapter
when enabled, else the current one), graph-scored rewards averaged per scorer, and the gallery
(captioned grid or clips) logged to the run dir and W&B.

    evaluation = Evaluation(cfg.eval, cfg.sampler, cfg.task, family, feed, rollout, run_dir,
                            gallery=cfg.gallery, wandb=logger.wandb,
                            media_every=cfg.wandb.media_every)
    metrics = evaluation.evaluate(step, version)      # eval_reward_mean, eval_<scorer>/..., eval_s

Owned by trainer.loop.Trainer; everything it reads is passed in, and the only state it keeps is
its own count of evaluations (W&B media go out every `media_every` of them).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from adapters.family import ModelFamily
from contract import PromptBundle, RolloutOutput, RolloutRequest, SamplerKind, Task
from trainer import gallery
from trainer.config import EvalConfig, SamplerSettings
from trainer.logs import WandbRun
from trainer.prompts import make_requests
from trainer.run_state import PromptFeed

Rollout = Callable[[list[RolloutRequest]], list[RolloutOutput]]


class Evaluation:
    """The held-out evaluation: `evaluate` and the gallery media it logs."""

    def __init__(self, config: EvalConfig, sampler: SamplerSettings, task: Task | None,
                 family: ModelFamily, feed: PromptFeed, rollout: Rollout, run_dir: Path,
                 gallery: bool, wandb: WandbRun | None, media_every: int):
        """feed: the held-out prompts (`eval_bundles`) and their scorer metadata and condition
        media (`eval_extras`); rollout: requests -> scored outputs (the trainer's, with its
        retry rule); gallery: record the gallery under run_dir; wandb: where media go, every
        `media_every` evaluations (None: nowhere)."""
        self.config, self.sampler, self.task = config, sampler, task
        self.family, self.feed, self.rollout = family, feed, rollout
        self.run_dir, self.gallery = run_dir, gallery
        self.wandb, self.media_every = wandb, media_every
        self.evaluations = 0

    @property
    def prompts(self) -> list[PromptBundle]:
        return self.feed.eval_bundles

    def evaluate(self, step: int, version: str) -> dict[str, float]:
        """Held-out prompts, ODE, fixed seeds, policy `version`; graph-scored rewards."""
        t0 = time.perf_counter()
        e = self.config
        extra_metadata, extra_media = self.feed.eval_extras()
        requests = make_requests(self.family, self.prompts, self.sampler,
                                 e.samples_per_prompt, seed=e.seed,
                                 version=version, sampler=SamplerKind.ODE,
                                 num_steps=e.num_steps, metadata=extra_metadata,
                                 media=extra_media, task=self.task)
        outputs = self.rollout(requests)
        totals = [r for o in outputs for r in o.rewards.total]
        out = {"eval_reward_mean": sum(totals) / len(totals)}
        for name, so in outputs[0].rewards.by_scorer.items():
            for key in so.scores:
                vals = [v for o in outputs for v in o.rewards.by_scorer[name].scores[key]
                        if v is not None]
                out[f"eval_{name}/{key}_mean"] = sum(vals) / max(len(vals), 1)
        if self.gallery:
            path = gallery.record(self.run_dir, self.family, step, outputs,
                                  prompts=[b.text or "" for b in self.prompts])
            self.log_gallery(step, path, outputs)
        out["eval_s"] = time.perf_counter() - t0
        return out

    def log_gallery(self, step: int, path: Path, outputs: list[RolloutOutput]) -> None:
        """The gallery's captioned grid (images) or clips with audio to W&B, with their prompt,
        rewards and step, every `media_every` evaluations."""
        self.evaluations += 1
        run = self.wandb
        if run is None or (self.evaluations - 1) % self.media_every:
            return
        if path.suffix == ".png":
            run.log_media(step, images=[(path, f"step {step} (left: step 0); rows: "
                                               "held-out prompts, captions: rewards")])
            return
        captions = gallery.sample_captions(outputs)
        group = len(outputs[0].seeds)
        tag = "step0" if step == 0 else "now"
        prompts = self.prompts
        clips = [(path / f"{tag}_prompt{i}.mp4",
                  f"step {step} | {prompts[i].text} | {captions[i * group]}")
                 for i in range(len(outputs)) if (path / f"{tag}_prompt{i}.mp4").is_file()]
        run.log_media(step, videos=clips)
