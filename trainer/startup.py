"""The trainer's start-up checks before step 1 (the checks themselves: trainer/checks.py): the
time convention (against the checkpoint's own scheduler where it has one, else on clean latents
of real media) and, for a LoRA policy, the LoRA map (a probe LoRA through the graph against the
learner's merged local rollout), each as the run's config enables it.

    startup = StartupChecks(cfg.checks, cfg.sampler, cfg.task, cfg.prompts, cfg.seed, family,
                            feed, learners, publisher, rollout, stage_conditions,
                            conditions=client.conditions)
    report = startup.run()          # cos_declared@0.5, ... / scheduler_*, lora_probe_* (floats)

Each failure raises StartupCheckError naming what differed (`adapter.time_convention`,
`lora_map`). Owned by trainer.loop.Trainer, which logs the report as `check_<name>` at step 0;
everything it reads is passed in and it keeps no state.
"""
from __future__ import annotations

import uuid
from typing import Callable, Sequence

import ray

from adapters.family import ModelFamily
from contract import (ConfigError, PolicyKind, PromptBundle, RolloutOutput, RolloutRequest,
                      SamplerKind, Task, normalize_media)
from trainer import checks
from trainer.config import ChecksConfig, PromptSource, SamplerSettings
from trainer.distributed import LocalLearners, RayTrainLearners
from trainer.prompts import make_requests, probe_clean_latents
from trainer.rollout_batch import StageConditions, build_batch
from trainer.run_state import PromptFeed
from trainer.sync import PolicyPublisher

# Tasks whose start-up checks run with the held-out prompts' condition media: an edit's source
# image conditions the model (shown to the conditioner, its latents a forward input) and no
# text-only request of an edit folder exists. Keyframe tasks (held state entries) run them on
# the family's text task.
CHECKED_WITH_MEDIA = (Task.EDIT,)

Rollout = Callable[[list[RolloutRequest]], list[RolloutOutput]]
Conditions = Callable[..., list]


def held_out_media(feed: PromptFeed, task: Task | None, n: int
                   ) -> tuple[list | None, list[dict] | None]:
    """The first n held-out prompts' condition media for the start-up checks of a task in
    CHECKED_WITH_MEDIA (an edit's source image): (MediaInputs per prompt, as requests carry
    them; role -> tensor per prompt, as the graph's stages read them); else (None, None).
    Fewer than n held-out records with media is a ConfigError naming `data.test`."""
    if task not in CHECKED_WITH_MEDIA:
        return None, None
    media = (feed.eval_extras()[1] or [])[:n]
    if len(media) < n or any(m is None for m in media):
        raise ConfigError(f"the {task.value} start-up checks run on the held-out prompts' "
                          "condition media", field="data.test", expected=f">= {n} records "
                          "with media", actual=len([m for m in media if m is not None]))
    return media, [{role: item.data for role, item in
                    normalize_media(m, task, "startup-check").items()} for m in media]


class StartupChecks:
    """`run` (the enabled checks) and each check on its own: `time_convention`, `lora_map`."""

    def __init__(self, config: ChecksConfig, sampler: SamplerSettings, task: Task | None,
                 probe_source: PromptSource, seed: int, family: ModelFamily, feed: PromptFeed,
                 learners: LocalLearners | RayTrainLearners, publisher: PolicyPublisher,
                 rollout: Rollout, stage_conditions: StageConditions,
                 conditions: Conditions | None):
        """config: which checks run and the LoRA map's tolerance; sampler, task: the requests'
        settings; probe_source: the prompts whose real media give the clean latents of the
        time-convention check without a scheduler; seed: the probe LoRA's; feed: the held-out
        prompts (`eval_bundles`) with their scorer metadata and condition media
        (`eval_extras`); learners: where the local sides run (`on_learner`); publisher: where
        the probe LoRA is published; rollout: requests -> scored outputs (the trainer's, with
        its retry rule); stage_conditions: what build_batch reads the rollouts' states with;
        conditions: the encoder stage's conditions of prompts, `(prompts, media=...) ->
        ConditionHandles` (RolloutClient.conditions), or None: the learner encodes the
        prompts itself (an in-process learner with its text encoders)."""
        self.config, self.sampler, self.task = config, sampler, task
        self.probe_source, self.seed, self.family, self.feed = probe_source, seed, family, feed
        self.learners, self.publisher, self.rollout = learners, publisher, rollout
        self.stage_conditions, self.conditions = stage_conditions, conditions

    @property
    def prompts(self) -> list[PromptBundle]:
        """The prompts the checks run on: the first two held-out ones."""
        return self.feed.eval_bundles[:2]

    def _handles(self, prompts: Sequence[PromptBundle], media: list[dict] | None = None):
        return None if self.conditions is None else self.conditions(prompts, media=media)

    def run(self) -> dict[str, float]:
        """The checks the config enables (the LoRA map for a LoRA policy only), one report."""
        c, report = self.config, {}
        if c.time_convention:
            report.update(self.time_convention())
        if c.lora_map and self.learners.kind is PolicyKind.LORA:
            report.update(self.lora_map())
        return report

    def time_convention(self) -> dict[str, float]:
        """Against the checkpoint's own scheduler where it has one (any weights), else on
        clean latents of real media (the embedded models' trained weights)."""
        prompts = self.prompts
        inputs, media = held_out_media(self.feed, self.task, len(prompts))
        sampling = make_requests(self.family, prompts, self.sampler, 1, seed=0,
                                 version=None, sampler=SamplerKind.ODE, media=inputs,
                                 task=self.task if inputs else None)[0].sampling
        if self.family.pipeline_scheduler(sampling) is not None:
            return self.learners.on_learner(checks.check_time_convention_scheduler, prompts,
                                            sampling, 0, 1e-5, self._handles(prompts, media),
                                            media)
        x0, probe = probe_clean_latents(self.probe_source, self.family)
        return self.learners.on_learner(checks.check_time_convention, x0, probe, 0.3, 0,
                                        self._handles(probe))

    def lora_map(self, publish_transform=None) -> dict[str, float]:
        """A probe LoRA published as "<run>/probe-*" (at step 0: before step 1) must change the
        graph's ODE rollout exactly as merging it into the training-form weights does.
        publish_transform: the probe's tensors -> what is published (tests break the map)."""
        tensors, scale = self.learners.on_learner(checks.probe_lora_ref, self.seed)
        sent = tensors
        if publish_transform:           # a deliberately broken map (tests): transformed here
            sent = publish_transform(ray.get(tensors).unpack())
        version, _ = self.publisher.publish(f"probe-{uuid.uuid4().hex[:4]}", 0, sent, scale)
        prompts = self.prompts
        metadata = (self.feed.eval_extras()[0] or [None])[:2]   # scorers may need it (OCR text)
        inputs, media = held_out_media(self.feed, self.task, len(prompts))  # an edit's sources
        num_steps = 4
        outs = {}
        for tag, ver in (("probe", version), ("base", "base")):
            reqs = make_requests(self.family, prompts, self.sampler, 2, seed=7, version=ver,
                                 sampler=SamplerKind.ODE, num_steps=num_steps,
                                 metadata=metadata if metadata[0] is not None else None,
                                 media=inputs, task=self.task if inputs else None)
            outs[tag] = self.rollout(reqs)
        states = {tag: build_batch(self.stage_conditions, prompts, o,
                                   [r.sampling for r in reqs], media).x0
                  for tag, o in outs.items()}
        seeds = [s for r in reqs for s in r.sampling.seeds]
        base = outs["base"]          # the encoder stage's conditions of these prompts
        local = self.learners.on_learner(
            checks.local_ode_with_probe, tensors, scale, prompts, seeds, num_steps,
            reqs[0].sampling, [o.conditions["cond"] for o in base],
            [o.conditions["uncond"] for o in base] if "uncond" in base[0].conditions else None,
            media)
        return checks.check_lora_map(states["probe"], states["base"], local,
                                     self.config.lora_map_atol)
