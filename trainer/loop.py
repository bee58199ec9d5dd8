"""The training loop: rollouts from the graph, one optimizer step per batch, LoRA sync back.

    ASYNC (default):   collect(k) -> submit(k+1, latest version) -> train(k) -> publish
    SERIAL:            collect(k) -> train(k) -> publish -> submit(k+1)
The rollout of step k+1 (rewards are scored per request inside the graph) overlaps training of
step k; its rows are then one sampling version stale. Rows staler than `max_staleness` are
DROPPED and counted (`dropped_stale_rows`), never trained on silently.
Sampling version: NFT samples with the "old" adapter (published as "<run>/old-<step>" at every
refresh); FlowGRPO and DPO sample with the current adapter ("<run>/v<step>").
"""
from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from adapters.registry import get_family
from contract import (Algorithm, ConfigError, PromptBundle, RolloutError, RolloutOutput,
                      RolloutRequest)
from deployments.client import RolloutClient
from deployments.failures import RetryBudget
from trainer import checks
from trainer.algorithms import old_decay
from trainer.checkpointing import Checkpoints
from trainer.config import PipelineMode, TrainerConfig, check_group_sizes, check_holder_ttl
from trainer.distributed import LearnerEMA, build_learners
from trainer.evaluation import Evaluation
from trainer.learner import Learner
from trainer.logs import MetricsLogger, WandbRun, plot_reward_curve
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.prompts import make_requests
from trainer.sync import PolicyPublisher
from trainer.run_state import PromptFeed
from trainer.startup import StartupChecks, held_out_media
from trainer.learner_worker import CONDITIONED_TASKS
from trainer.rollout_batch import StageConditions, build_batch, canonical_media

# A batch lost to a retryable failure is resubmitted until this budget is spent: Serve replacing
# a replica means a process start and a model load (minutes for a large model on a GPU node).
ROLLOUT_RETRY = RetryBudget(step_s=2.0, max_step_s=20.0, budget_s=600.0)


@dataclass
class Pending:
    step: int
    prompts: list[PromptBundle]
    requests: list[RolloutRequest]
    response: Any
    submitted: float
    data_state: dict | None = None     # the prompt feed's position before this batch


def stale_rows(versions: Sequence[str], published: Sequence[str], max_staleness: int) -> list[bool]:
    """Per row: True if its sampling version lags the latest by more than max_staleness
    versions (or is unknown to this run)."""
    index = {v: i for i, v in enumerate(published)}
    latest = len(published) - 1
    return [v not in index or latest - index[v] > max_staleness for v in versions]


class Trainer:
    """The training loop (this module's docstring), composed of the objects it owns: the prompt
    feed, the learners, the publisher, the logger, the evaluation (trainer/evaluation.py) and
    the checkpoints (trainer/checkpointing.py) and the start-up checks (trainer/startup.py),
    each constructed with what it reads; the loop's counters (step, sampling versions, dropped
    rows, retries) are the Trainer's own."""

    def __init__(self, cfg: TrainerConfig, client: RolloutClient | None = None,
                 progress: bool = False):
        torch.set_num_threads(1)
        self.cfg = cfg
        self.graph = cfg.graph_config()
        check_holder_ttl(cfg, self.graph)      # before any weight loads
        check_group_sizes(cfg, self.graph)
        self.family = get_family(self.graph.adapter, self.graph.weights_path,
                                 self.graph.adapter_options)
        self.client = client or RolloutClient.connect(self.graph.app_name)
        self.feed = PromptFeed(cfg, self.family.conditioner.tokenize)
        self.eval_prompts = self.feed.eval_bundles
        if cfg.task is not None:        # served by the family, its media in every record
            if cfg.task not in self.family.spec.tasks:
                raise ConfigError(f"{self.family.name} does not serve this task", field="task",
                                  expected=[t.value for t in self.family.spec.tasks],
                                  actual=cfg.task.value)
            self.feed.check_task_media(cfg.task, self.family.spec.tasks[cfg.task],
                                       self.family.spec.optional_media.get(cfg.task, ()))
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Conditions are the encoder stage's, by reference: no text encoder in this process.
        # The VAE encoder only for a task with condition media (their state entries and
        # forward inputs are re-encoded from the request's media).
        media = cfg.task in CONDITIONED_TASKS
        self.learner = None if cfg.learner.distributed else Learner.load(
            self.family, cfg.lora, cfg.optimizer, cfg.seed, cfg.learner, text_encoders=False,
            media_encoders=media)
        self.conditions = StageConditions(
            self.family, self.learner.media_modules if self.learner is not None else
            self.family.load_media_encoders() if media else {})
        # where the step runs: this process, or a Ray Train worker group (trainer/distributed.py)
        # that holds the model; the encoder stage's probe sets the learners' condition check
        probe_media = held_out_media(self.feed, cfg.task, 1)[1]
        self.learners = build_learners(cfg, self.learner, self.graph, self.run_dir,
                                       self.client.conditions(self.eval_prompts[:1],
                                                              media=probe_media)[0])
        self.publisher = PolicyPublisher(self.graph.policy_store,
                                         f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}",
                                         kind=self.learners.kind)
        tracker = (WandbRun(self.run_dir, cfg.wandb.mode, cfg.wandb.project, cfg.wandb.name,
                            cfg.model_dump(mode="json"), resume=cfg.resume)
                   if cfg.wandb.enabled else None)
        self.logger = MetricsLogger(self.run_dir, fresh=not cfg.resume, wandb=tracker)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.sampling_versions: list[str] = []
        self.dropped_stale_rows = 0
        self.rollout_retries = 0
        self.progress = progress
        # the evaluation EMA lives on the learner (rank 0), beside the tensors it averages
        self.ema = LearnerEMA(self.learners, cfg.ema) if cfg.ema.enabled else None
        self.history: list[dict[str, float]] = []
        self.evaluation = Evaluation(cfg.eval, cfg.sampler, cfg.task, self.family, self.feed,
                                     self.rollout, self.run_dir, gallery=cfg.gallery,
                                     wandb=self.logger.wandb, media_every=cfg.wandb.media_every)
        self.checkpoints = Checkpoints(self.run_dir, cfg, self.learners, self.publisher,
                                       self.feed, self.ema, self.gen)
        self.startup = StartupChecks(cfg.checks, cfg.sampler, cfg.task, cfg.prompts, cfg.seed,
                                     self.family, self.feed, self.learners, self.publisher,
                                     self.rollout, self.conditions,
                                     conditions=self.client.conditions)

    # ---- versions ------------------------------------------------------------------------------
    @property
    def samples_with_old(self) -> bool:
        return self.cfg.algorithm is Algorithm.NFT

    @property
    def sampling_adapter(self) -> str:
        """The adapter the graph samples with (NFT: old; FlowGRPO, DPO: the trained one)."""
        return OLD_ADAPTER if self.samples_with_old else TRAIN_ADAPTER

    def publish_sampling(self) -> tuple[str, float]:
        name = f"old-{self.step}" if self.samples_with_old else f"v{self.step}"
        version, seconds = self.publisher.publish(
            name, self.step, *self.learners.export_packed(self.sampling_adapter))
        self.sampling_versions.append(version)
        return version, seconds

    def current_version(self) -> str:
        """The current adapter's version (published on demand for NFT, whose sampler is old)."""
        if not self.samples_with_old:
            return self.sampling_versions[-1]
        version = self.publisher.version(f"v{self.step}")
        if version not in self.publisher.tensors:
            self.publisher.publish(f"v{self.step}", self.step,
                                   *self.learners.export_packed(TRAIN_ADAPTER))
        return version

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
        """The held-out evaluation (trainer/evaluation.py) of the evaluated policy now."""
        return self.evaluation.evaluate(self.step, self.eval_version())

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, pending: Pending | None = None) -> Path:
        """A checkpoint (trainer/checkpointing.py) of the run now, `pending` in flight."""
        return self.checkpoints.save(self.step, self.sampling_versions, self.dropped_stale_rows,
                                     self.rollout_retries, pending)

    def resume(self) -> dict | None:
        """Restore the latest checkpoint (a changed config is refused, naming the fields) and
        the loop's counters; returns the in-flight batch's sampling tensors, if any."""
        resumed = self.checkpoints.load()
        self.step = resumed.step
        self.dropped_stale_rows = resumed.dropped_stale_rows
        self.rollout_retries = resumed.rollout_retries
        return resumed.inflight

    # ---- rollouts ------------------------------------------------------------------------------
    @property
    def tree_branch(self):
        """Tree GRPO (flow_grpo.branch): the branch every training request asks for; the
        outputs' trees give the batch its node ids (build_batch) and plan_update per-node
        advantages. None = independent rows."""
        if self.cfg.algorithm is not Algorithm.FLOW_GRPO:
            return None
        return self.cfg.flow_grpo.branch

    def submit(self, k: int, version: str | None = None) -> Pending:
        """Step k's rollouts with the latest sampling version (or `version`); the prompts come
        from the feed (scorer metadata and condition media with them)."""
        cfg = self.cfg
        batch = self.feed.batch(k, cfg.prompts_per_step)
        requests = make_requests(self.family, batch.bundles, cfg.sampler, cfg.samples_per_prompt,
                                 seed=(cfg.seed * 100_003 + k) * 1000,
                                 version=version or self.sampling_versions[-1],
                                 metadata=batch.metadata, media=batch.media, task=cfg.task,
                                 step=k, branch=self.tree_branch)
        return Pending(k, batch.bundles, requests, self.client.submit(requests),
                       time.perf_counter(), batch.data_state)

    def collect(self, pending: Pending) -> tuple[list[RolloutOutput], float]:
        """Outputs of a submitted batch; outputs lost to a retryable failure (a replica died:
        ReplicaFailedError; a stage or the policy store briefly unavailable:
        StageUnavailableError) are resampled with the same requests (same seeds and version)
        until ROLLOUT_RETRY's budget has passed, with a growing wait between attempts, counted
        in `rollout_retries`; a restarted policy store gets this run's versions back first."""
        t0, started = time.perf_counter(), time.monotonic()
        for attempt in itertools.count(1):
            try:
                return self.client.collect(pending.response), time.perf_counter() - t0
            except RolloutError as exc:
                if not exc.retryable or ROLLOUT_RETRY.spent(started):
                    raise
                self.rollout_retries += 1
                ROLLOUT_RETRY.wait(attempt)
                self.publisher.ensure_store()
                pending.response = self.client.submit(pending.requests)
        raise AssertionError("unreachable")

    def rollout(self, requests: list[RolloutRequest]) -> list[RolloutOutput]:
        """Synchronous rollout with the same retry rule as `collect`."""
        return self.collect(Pending(self.step, [], requests, self.client.submit(requests),
                                    time.perf_counter()))[0]

    # ---- training --------------------------------------------------------------------------------
    def after_update(self) -> float:
        """Refresh/publish the sampling policy after optimizer step `self.step`; sync seconds."""
        if self.samples_with_old:
            if self.step % self.cfg.nft.old_refresh_every != 0:
                return 0.0
            self.learners.refresh_old(old_decay(self.step, self.cfg.nft.decay))
        return self.publish_sampling()[1]

    def train_on(self, outputs: list[RolloutOutput], pending: Pending) -> dict[str, float]:
        samplings = [r.sampling for r in pending.requests]
        media = canonical_media(pending.requests)
        if self.cfg.checks.token_ids:
            checks.check_token_ids(pending.prompts, outputs, self.family.spec.encoder_names)
        batch = build_batch(self.conditions, pending.prompts, outputs, samplings, media)
        stale = stale_rows(batch.versions, self.sampling_versions,
                           self.cfg.pipeline.max_staleness)
        metrics: dict[str, float] = {"stale_rows": float(sum(stale))}
        if any(stale):
            self.dropped_stale_rows += sum(stale)
            if all(stale):
                return metrics | {"dropped_stale_rows": float(self.dropped_stale_rows)}
            fresh = [i for i, o in enumerate(outputs) if stale_rows(
                [o.policy_version], self.sampling_versions, self.cfg.pipeline.max_staleness) == [False]]
            batch = build_batch(self.conditions, [pending.prompts[i] for i in fresh],
                                [outputs[i] for i in fresh], [samplings[i] for i in fresh],
                                [media[i] for i in fresh])
        parity_due = self.step % self.cfg.checks.logprob_parity_every == 0
        for rows, _ in batch.window_groups if parity_due else ():   # one per SDE window
            sub = batch.select(rows)            # on the learner (rank 0 of a worker group)
            parity = self.learners.on_learner(
                checks.logprob_mismatch_by_ref, sub.trajectory, sub.cond,
                {v: self.publisher.ref_of(v) for v in set(sub.versions)}, sub.versions,
                self.cfg.checks.logprob_ratio_tol, sub.uncond, sub.inputs)
            for key, value in parity.items():     # the worst window counts
                metrics[key] = max(metrics.get(key, value), value)
        metrics["reward_mean"] = float(batch.rewards.mean())
        metrics["reward_std"] = float(batch.rewards.std())
        for name, vals in batch.scores.items():
            t = torch.tensor(vals)
            metrics[f"reward_{name}_mean"], metrics[f"reward_{name}_std"] = (
                float(t.mean()), float(t.std()) if len(vals) > 1 else 0.0)
        # the learner's weights now are the last version it published: its old policy
        metrics.update(self.learners.update(batch, self.gen, old_version=(
            None if self.samples_with_old else self.sampling_versions[-1])))
        metrics.update(self.learners.last_timing)      # rank 0's fetch / update seconds
        metrics["rows"] = float(batch.rows)
        metrics["dropped_stale_rows"] = float(self.dropped_stale_rows)
        metrics["rollout_retries"] = float(self.rollout_retries)
        return metrics

    def run(self) -> list[dict[str, float]]:
        try:
            return self._run()
        finally:
            self.learners.close()

    def _run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        inflight = self.resume() if cfg.resume else None
        report = self.startup.run() if self.step == 0 else {}
        # the in-flight batch's version before the current one, as the uninterrupted run had it
        resumed = self.checkpoints.publish_inflight(inflight, self.sampling_adapter, self.step)
        if resumed is not None:
            self.sampling_versions.append(resumed)
        self.publish_sampling()
        if report:
            self.logger.log(self.step, {f"check_{k}": v for k, v in report.items()})
        if self.step == 0:
            self.logger.log(0, self.evaluate())
        bar = _progress(cfg.steps, self.step) if self.progress else None
        pending = self.submit(self.step, resumed)
        t_last = time.perf_counter()
        while self.step < cfg.steps:
            k, current = self.step, pending
            outputs, wait = self.collect(current)
            graph_s = time.perf_counter() - current.submitted
            nxt = k + 1 < cfg.steps
            if nxt and cfg.pipeline.mode is PipelineMode.ASYNC:
                pending = self.submit(k + 1)
            t0 = time.perf_counter()
            metrics = self.train_on(outputs, current)
            t_train = time.perf_counter() - t0
            self.step += 1
            sync_s = self.after_update()
            if self.ema is not None:
                self.ema.update(self.step)
            if nxt and cfg.pipeline.mode is PipelineMode.SERIAL:
                pending = self.submit(k + 1)
            now = time.perf_counter()
            metrics.update(rollout_wait_s=wait, rollout_graph_s=graph_s, train_s=t_train,
                           sync_s=sync_s, step_s=now - t_last,
                           engine_run_s=_mean(o.metrics.get("run_time_s") for o in outputs),
                           score_s=_mean(o.metrics.get("score_s") for o in outputs))
            metrics["samples_per_s"] = metrics.get("rows", 0.0) / max(now - t_last, 1e-9)
            if self.step % cfg.eval.every == 0 or self.step == cfg.steps:
                metrics.update(self.evaluate())
            self.logger.log(self.step, metrics)
            self.history.append(metrics)
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.checkpoint(pending if nxt else None)
            t_last = time.perf_counter()   # step_s: rollout wait + train + sync (no eval/ckpt)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                loss=f"{metrics.get('loss', float('nan')):.4f}",
                                **({} if self.feed.epoch is None else
                                   {"epoch": f"{self.feed.epoch:.2f}"}))
        if bar is not None:
            bar.close()
        plot_reward_curve(self.run_dir)
        self.logger.close()
        return self.history



def _mean(values) -> float:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _progress(total: int, initial: int):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step")
