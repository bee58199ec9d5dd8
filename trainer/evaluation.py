"""Evaluation of a training run: held-out prompts sampled with ODE at fixed seeds through the
graph with the evaluated policy (the EMA of the trained adapter when enabled, else the current
one), graph-scored rewards averaged per scorer, and the gallery (captioned grid or clips) logged
to the run dir and W&B. A mixin of trainer.loop.Trainer, reading its cfg, family, feed,
eval_prompts, learner, publisher, ema, logger and step.
"""
from __future__ import annotations

import time
from pathlib import Path

from contract import RolloutOutput, SamplerKind
from trainer import gallery
from trainer.lora import TRAIN_ADAPTER
from trainer.prompts import make_requests


class TrainerEvaluation:
    """Trainer.eval_version / evaluate / log_gallery."""

    def eval_version(self) -> str:
        """The evaluated policy: the EMA of the trained adapter when enabled, else the current."""
        if self.ema is None:
            return self.current_version()
        _, scale = self.learners.export_packed(TRAIN_ADAPTER)
        if not self.ema.started:             # initialised from the weights before step 1
            self.ema.update(self.step)
        return self.publisher.publish(f"ema-{self.step}", self.step, self.ema.packed_ref(),
                                      scale)[0]

    def evaluate(self) -> dict[str, float]:
        """Held-out prompts, ODE, fixed seeds, the current adapter; graph-scored rewards."""
        t0 = time.perf_counter()
        e = self.cfg.eval
        extra_metadata, extra_media = self.feed.eval_extras()
        requests = make_requests(self.family, self.eval_prompts, self.cfg.sampler,
                                 e.samples_per_prompt, seed=e.seed,
                                 version=self.eval_version(), sampler=SamplerKind.ODE,
                                 num_steps=e.num_steps, metadata=extra_metadata,
                                 media=extra_media, task=self.cfg.task)
        outputs = self.rollout(requests)
        totals = [r for o in outputs for r in o.rewards.total]
        out = {"eval_reward_mean": sum(totals) / len(totals)}
        for name, so in outputs[0].rewards.by_scorer.items():
            for key in so.scores:
                vals = [v for o in outputs for v in o.rewards.by_scorer[name].scores[key]
                        if v is not None]
                out[f"eval_{name}/{key}_mean"] = sum(vals) / max(len(vals), 1)
        if self.cfg.gallery:
            path = gallery.record(self.run_dir, self.family, self.step, outputs,
                                  prompts=[b.text or "" for b in self.eval_prompts])
            self.log_gallery(path, outputs)
        out["eval_s"] = time.perf_counter() - t0
        return out

    def log_gallery(self, path: Path, outputs: list[RolloutOutput]) -> None:
        """The gallery's captioned grid (images) or clips with audio to W&B, with their prompt,
        rewards and step, every `wandb.media_every` evaluations."""
        self.evaluations += 1
        run = self.logger.wandb
        if run is None or (self.evaluations - 1) % self.cfg.wandb.media_every:
            return
        if path.suffix == ".png":
            run.log_media(self.step, images=[(path, f"step {self.step} (left: step 0); rows: "
                                                   "held-out prompts, captions: rewards")])
            return
        captions = gallery.sample_captions(outputs)
        group = len(outputs[0].seeds)
        tag = "step0" if self.step == 0 else "now"
        clips = [(path / f"{tag}_prompt{i}.mp4",
                  f"step {self.step} | {self.eval_prompts[i].text} | {captions[i * group]}")
                 for i in range(len(outputs)) if (path / f"{tag}_prompt{i}.mp4").is_file()]
        run.log_media(self.step, videos=clips)
