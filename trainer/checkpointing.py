"""Checkpoints of a training run and exact resume (what they hold: trainer/run_state.py): the
adapters, the optimizer (the worker group's too), the generator, the prompt feed's position and
sampling version of the in-flight batch, the EMA and the config.

    checkpoints = Checkpoints(run_dir, cfg, learners, publisher, feed, ema, gen)
    checkpoints.save(step, sampling_versions, dropped_stale_rows, rollout_retries, pending)
    resumed = checkpoints.load()     # restores learners, gen, feed, ema; returns the counters
    version = checkpoints.publish_inflight(resumed.inflight, role, step)

Owned by trainer.loop.Trainer, which passes its counters to `save` and takes them back from
`load`; the objects it restores are the ones it was constructed with.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.config import TrainerConfig
from trainer.distributed import LearnerEMA, LocalLearners, RayTrainLearners
from trainer.logs import load_checkpoint, save_checkpoint
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.run_state import (PromptFeed, check_resume_config, generator_state,
                               set_generator_state)
from trainer.sync import PolicyPublisher

if TYPE_CHECKING:
    from trainer.loop import Pending


@dataclass
class Resumed:
    """The loop's counters as of the restored checkpoint, and the in-flight batch's sampling
    tensors (None when the checkpoint had no batch in flight)."""

    step: int
    dropped_stale_rows: int
    rollout_retries: int
    inflight: dict[str, torch.Tensor] | None


class Checkpoints:
    """`save` / `load` of the run's checkpoints and `publish_inflight` on resume."""

    def __init__(self, run_dir: Path, cfg: TrainerConfig,
                 learners: LocalLearners | RayTrainLearners, publisher: PolicyPublisher,
                 feed: PromptFeed, ema: LearnerEMA | None, gen: torch.Generator):
        """cfg: the run's config, saved whole and compared on resume; learners, publisher, feed,
        ema, gen: what a checkpoint reads and `load` restores in place."""
        self.run_dir, self.cfg = run_dir, cfg
        self.learners, self.publisher = learners, publisher
        self.feed, self.ema, self.gen = feed, ema, gen

    def save(self, step: int, sampling_versions: list[str], dropped_stale_rows: int,
             rollout_retries: int, pending: Pending | None = None) -> Path:
        """Everything the next steps depend on (run_state.py): adapters, optimizer, generator,
        the prompt position and sampling version of the in-flight batch `pending`, the EMA,
        and the loop's counters."""
        tensors = {TRAIN_ADAPTER: self.learners.export(TRAIN_ADAPTER)[0],
                   OLD_ADAPTER: self.learners.export(OLD_ADAPTER)[0]}
        if pending is not None:
            tensors["pending"] = self.publisher.tensors_of(pending.requests[0].policy_version)
        ema = None if self.ema is None else self.ema.tensors     # fetched from the learner
        if ema is not None:
            tensors["ema"] = ema
        data_state = (pending.data_state if pending is not None else
                      None if self.feed.data is None else self.feed.data.state())
        return save_checkpoint(self.run_dir, step, tensors, self.learners.optimizer_state(), {
            "sampling_versions": sampling_versions, "algorithm": self.cfg.algorithm.value,
            "dropped_stale_rows": dropped_stale_rows,
            "rollout_retries": rollout_retries, "generator": generator_state(self.gen),
            "data_state": data_state,
            "ema_updates": None if self.ema is None else self.ema.updates,
            "config": self.cfg.model_dump(mode="json")})

    def load(self) -> Resumed:
        """Restore the latest checkpoint onto the learners, generator, feed and EMA; a config
        that differs from the checkpoint's (beyond run length and outputs) is refused, naming
        the fields, before anything is restored."""
        tensors, optimizer, state = load_checkpoint(self.run_dir)
        if "config" in state:
            check_resume_config(state["config"], self.cfg)
        self.learners.load_state({name: tensors[name] for name in (TRAIN_ADAPTER, OLD_ADAPTER)},
                                 optimizer)     # the learner here, or every worker's
        if "generator" in state:
            set_generator_state(self.gen, state["generator"])
        if self.feed.data is not None:
            self.feed.restore(state.get("data_state"))
        if self.ema is not None and "ema" in tensors:      # back onto the learner
            self.ema.restore(tensors["ema"], int(state.get("ema_updates") or 0))
        return Resumed(step=int(state["step"]),
                       dropped_stale_rows=int(state.get("dropped_stale_rows", 0)),
                       rollout_retries=int(state.get("rollout_retries", 0)),
                       inflight=tensors.get("pending"))

    def publish_inflight(self, saved: dict[str, torch.Tensor] | None, role: str,
                         step: int) -> str | None:
        """On resume: the in-flight batch's sampling tensors `saved` (Resumed.inflight),
        published before the current sampling version (as the uninterrupted run had it) when
        they differ from the `role` adapter's; returns the version, or None."""
        if saved is None:
            return None
        current, scale = self.learners.export(role)
        if set(saved) == set(current) and all(torch.equal(saved[k], current[k]) for k in saved):
            return None
        version, _ = self.publisher.publish(f"inflight-{step}", step, saved, scale)
        return version
