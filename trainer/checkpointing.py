"""Checkpoints of a training run and exact resume (what they hold: trainer/run_state.py): the
adapters, the optimizer (the worker group's too), the generator, the prompt feed's position and
sampling version of the in-flight batch, the EMA and the config. A mixin of
trainer.loop.Trainer, reading and restoring its learner, learners, publisher, feed, ema, gen,
step and counters.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.logs import load_checkpoint, save_checkpoint
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.run_state import check_resume_config, generator_state, set_generator_state

if TYPE_CHECKING:
    from trainer.loop import Pending


class TrainerCheckpoints:
    """Trainer.checkpoint / resume / publish_resumed."""

    def checkpoint(self, pending: Pending | None = None) -> Path:
        """Everything the next steps depend on (run_state.py): adapters, optimizer, generator,
        the prompt position and sampling version of the in-flight batch `pending`, the EMA."""
        tensors = {TRAIN_ADAPTER: self.learners.export(TRAIN_ADAPTER)[0],
                   OLD_ADAPTER: self.learners.export(OLD_ADAPTER)[0]}
        if pending is not None:
            tensors["pending"] = self.publisher.tensors_of(pending.requests[0].policy_version)
        ema = None if self.ema is None else self.ema.tensors     # fetched from the learner
        if ema is not None:
            tensors["ema"] = ema
        data_state = (pending.data_state if pending is not None else
                      None if self.feed.data is None else self.feed.data.state())
        return save_checkpoint(self.run_dir, self.step, tensors, self.learners.optimizer_state(), {
            "sampling_versions": self.sampling_versions, "algorithm": self.cfg.algorithm.value,
            "dropped_stale_rows": self.dropped_stale_rows,
            "rollout_retries": self.rollout_retries, "generator": generator_state(self.gen),
            "data_state": data_state,
            "ema_updates": None if self.ema is None else self.ema.updates,
            "config": self.cfg.model_dump(mode="json")})

    def resume(self) -> None:
        """Restore the latest checkpoint; a config that differs from the checkpoint's (beyond
        run length and outputs) is refused, naming the fields."""
        tensors, optimizer, state = load_checkpoint(self.run_dir)
        if "config" in state:
            check_resume_config(state["config"], self.cfg)
        self.learners.load_state({name: tensors[name] for name in (TRAIN_ADAPTER, OLD_ADAPTER)},
                                 optimizer)     # the learner here, or every worker's
        self.step = int(state["step"])
        self.dropped_stale_rows = int(state.get("dropped_stale_rows", 0))
        self.rollout_retries = int(state.get("rollout_retries", 0))
        if "generator" in state:
            set_generator_state(self.gen, state["generator"])
        if self.feed.data is not None:
            self.feed.restore(state.get("data_state"))
        if self.ema is not None and "ema" in tensors:      # back onto the learner
            self.ema.restore(tensors["ema"], int(state.get("ema_updates") or 0))
        self._resume_pending = tensors.get("pending")

    def publish_resumed(self) -> str | None:
        """On resume: the in-flight batch's sampling version, published before the current one
        (as the uninterrupted run had it) when it differs; returns it, or None."""
        saved, self._resume_pending = self._resume_pending, None
        if saved is None:
            return None
        role = OLD_ADAPTER if self.samples_with_old else TRAIN_ADAPTER
        current, scale = self.learners.export(role)
        if set(saved) == set(current) and all(torch.equal(saved[k], current[k]) for k in saved):
            return None
        version, _ = self.publisher.publish(f"inflight-{self.step}", self.step, saved, scale)
        self.sampling_versions.append(version)
        return version
