"""Where the learner's step runs: in the trainer process, or on a Ray Train worker group.

    learners = build_learners(cfg, learner, graph, run_dir, probe)   # LocalLearners | RayTrainLearners
    metrics = learners.update(batch, gen)         # one optimizer step on the whole batch
    learners.refresh_old(decay); learners.optimizer_state(); learners.load_state(...)
    learners.export_packed(name); learners.on_learner(fn, *args)    # the policy; checks

The trainer process is the controller (rollouts through handles, advantages, publishing,
evaluation, checkpoints). With `learner.workers = N`, N Ray Train workers
(`ray.train.torch.TorchTrainer`, one process group, gloo on CPU / nccl on GPU) each hold the
transformer(s) with the policy and the optimizer -- never a text encoder: the batch's
conditions travel as the encoder stage's ConditionHandles and each worker fetches its shard's
rows from the object store (trainer/rollout_batch.py) -- and train their shard of the prompt
groups (`updates.shard_plan`). The controller then holds no model: the policy is rank 0's
exports, object refs it publishes without fetching; start-up checks and the log-prob parity
check run on rank 0 (`on_learner`: every rank under FSDP2, whose forwards gather shards). The
interface is small: a plan shard in, metrics + exported weights (one PackedTensors object) out;
the worker's side of it is trainer/learner_worker.py.

LoRA: every worker holds the whole adapter; the gradients of the shards are summed by one
all-reduce of the flattened LoRA gradients before the step (data parallel), so every replica of
the adapter takes the same step. Full fine-tuning: the transformer (and its frozen old /
reference copies) is sharded with FSDP2 (`fully_shard`), gradients reduce-scattered as sums;
exports gather the full tensors. Every loss term is divided by the whole batch's count, so N
workers take the step one worker takes on the union batch.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import ray
import torch

from contract import (Algorithm, ConditionHandle, PackedTensors, PolicyKind,
                      StageUnavailableError)
from trainer.learner import Learner
from trainer.learner_config import LearnerConfig, Placement
from trainer.learner_worker import (Job, LearnerChannel, ema_export, ema_restore, ema_update,
                                    learner_worker, probe_signature, with_conditions)
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.updates import Batch, plan_update, run_update, shard_plan

START_TIMEOUT_S = 900.0          # the worker group's start: processes, model loads


class Colocation:
    """Colocated placement: the rollout engines sleep while the learners step (the embedded
    engine pauses between steps; vLLM-Omni sleep level 1 frees its weights and cache)."""

    def __init__(self, app_name: str | None):
        self.app_name = app_name
        self.cycles = 0

    @contextmanager
    def learning(self) -> Iterator[None]:
        if self.app_name is None:
            yield
            return
        call_every_replica(self.app_name, "DiTRollout", "sleep", 1)
        try:
            yield
        finally:
            call_every_replica(self.app_name, "DiTRollout", "wake_up")
            self.cycles += 1


def call_every_replica(app: str, deployment: str, method: str, *args,
                       attempts: int = 256) -> set[int]:
    """Call `method` on every running replica of a deployment (it returns the replica's pid);
    a handle routes each call to one replica, so call until every running one answered."""
    from ray import serve
    state = serve.status().applications[app].deployments[deployment]
    running = int(state.replica_states.get("RUNNING", 0))
    handle = getattr(serve.get_deployment_handle(deployment, app_name=app), method)
    seen: set[int] = set()
    for _ in range(attempts):
        seen.add(handle.remote(*args).result())
        if len(seen) >= running:
            return seen
    raise StageUnavailableError(f"{deployment}.{method} reached {len(seen)} of {running} "
                                "replicas", field="learner.placement", expected=running,
                                actual=len(seen))


class LocalLearners:
    """The learner in the trainer process (it fetches the batch's conditions itself)."""

    def __init__(self, cfg, learner: Learner, colocation: Colocation,
                 probe: ConditionHandle | None = None):
        self.cfg, self.learner, self.colocation = cfg, learner, colocation
        self.last_timing: dict[str, float] = {}     # (a worker group's rank 0 reports its own)
        if probe is not None:
            learner.condition_signature = probe_signature(learner.family, probe)

    @property
    def kind(self) -> PolicyKind:
        return self.learner.kind

    def export_packed(self, name: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        return self.learner.export_packed(name)

    def export(self, name: str = TRAIN_ADAPTER) -> tuple[dict[str, torch.Tensor], float]:
        return self.learner.export(name)

    def on_learner(self, fn, *args):
        """fn(learner, *args) on the learner (checks, parity)."""
        return fn(self.learner, *args)

    def update(self, batch: Batch, gen: torch.Generator, algorithm: Algorithm | None = None,
               old_version: str | None = None) -> dict[str, float]:
        """One step here; old_version: the learner's published pre-step version (FlowGRPO)."""
        plan = plan_update(algorithm or self.cfg.algorithm, batch, self.cfg, gen, old_version)
        plan = with_conditions(plan, self.learner)
        with self.colocation.learning():
            return run_update(self.learner, plan, self.cfg)

    def refresh_old(self, decay: float) -> None:
        self.learner.refresh_old(decay)

    def optimizer_state(self) -> dict:
        return self.learner.optimizer.state_dict()

    def load_state(self, adapters: Mapping[str, Mapping[str, torch.Tensor]],
                   optimizer: Mapping) -> None:
        for name, tensors in adapters.items():
            self.learner.load_adapter(name, tensors)
        self.learner.optimizer.load_state_dict(optimizer)

    def close(self) -> None:
        pass


# ---- the worker group ---------------------------------------------------------------------------
class RayTrainLearners:
    """N learner workers in one Ray Train TorchTrainer run that lives as long as the trainer:
    `fit()` runs in a thread; each worker serves jobs from the channel until STOP. The policy
    here is rank 0's latest export of each adapter: (object ref, scale), never fetched but for
    a checkpoint or an evaluation EMA. probe: one encoding of the encoder stage, which sets the
    workers' ConditionSignature (None: batches carry their conditions as tensors)."""

    def __init__(self, cfg, graph, run_dir: Path, colocation: Colocation,
                 probe: ConditionHandle | None = None):
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        self.cfg, self.colocation = cfg, colocation
        self.kind = PolicyKind(cfg.learner.fine_tune)
        self.exports: dict[str, tuple[Any, float]] = {}     # adapter -> (ref, scale)
        self.last_timing: dict[str, float] = {}
        # the workers load a model before they report ready: more than Ray Train's default 60 s
        # on a loaded machine or for a large checkpoint (read by fit(), passed to its actors)
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(int(START_TIMEOUT_S)))
        s: LearnerConfig = cfg.learner
        self.world = s.workers
        self.timeout_s = float(s.collective_timeout_s) + 60.0
        self.channel = LearnerChannel.options(name=None).remote(self.world)
        self._jobs = 0
        self._result: dict[str, Any] = {}
        trainer = TorchTrainer(
            learner_worker, train_loop_config={"cfg": cfg, "graph": graph,
                                               "channel": self.channel},
            torch_config=TorchConfig(backend=s.process_group_backend,
                                     timeout_s=s.collective_timeout_s),
            scaling_config=ScalingConfig(num_workers=self.world,
                                         use_gpu=s.device.startswith("cuda"),
                                         resources_per_worker=dict(s.resources_per_worker),
                                         label_selector=dict(s.label_selector) or None,
                                         placement_strategy="PACK"),
            run_config=RunConfig(name=f"learners-{uuid.uuid4().hex[:8]}",
                                 storage_path=str(Path(run_dir).resolve() / "ray_train"),
                                 failure_config=FailureConfig(max_failures=0)))
        self._thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True,
                                        name="ray-train-learners")
        self._thread.start()
        replies = self._call(Job.START, [probe] * self.world, START_TIMEOUT_S)
        # what each worker holds (its bundle and parameter bytes), the initial weights' refs
        self.worker_resources = [replies[r]["resources"] for r in range(self.world)]
        self.worker_modules = [replies[r]["modules"] for r in range(self.world)]
        self.exports.update(replies[0]["exports"])

    def _fit(self, trainer) -> None:
        try:
            self._result["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting controller
            self._result["error"] = exc

    def _call(self, kind: Job, payloads: list, timeout_s: float | None = None) -> dict[int, Any]:
        self._jobs += 1
        job_id = f"{kind.value}-{self._jobs}"
        ray.get(self.channel.post.remote(job_id, kind.value, payloads))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            if "error" in self._result:
                raise self._result["error"]
            replies = ray.get(self.channel.wait.remote(job_id, self.world, 10.0))
            if replies is not None:
                break
            if not self._thread.is_alive():
                raise RuntimeError(f"the learner worker group ended before answering "
                                   f"{kind.value}: {self._result.get('result')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"learner workers did not answer {kind.value} within "
                                   f"{timeout_s or self.timeout_s:.0f} s")
        for rank, reply in sorted(replies.items()):
            if reply[0] == "error":
                exc = reply[1]
                exc.add_note(f"learner worker rank {rank}:\n{reply[2]}")
                raise exc
        return {rank: reply[1] for rank, reply in replies.items()}

    def update(self, batch: Batch, gen: torch.Generator, algorithm: Algorithm | None = None,
               old_version: str | None = None) -> dict[str, float]:
        """One step: the plan over the whole batch here, each worker its shard."""
        plan = plan_update(algorithm or self.cfg.algorithm, batch, self.cfg, gen, old_version)
        s = self.cfg.learner
        balance = s.fine_tune is PolicyKind.FULL
        shards = [ray.put(shard_plan(plan, r, self.world, s.micro_batch_size, balance))
                  for r in range(self.world)]
        with self.colocation.learning():
            reply = self._call(Job.UPDATE, [[ref] for ref in shards])[0]
        if reply["export"] is not None:
            self.exports[TRAIN_ADAPTER] = reply["export"]
        self.last_timing = reply["timing"]     # rank 0's condition fetch and update seconds
        return reply["metrics"]

    def refresh_old(self, decay: float) -> None:
        self.exports[OLD_ADAPTER] = self._call(Job.REFRESH, [decay] * self.world)[0]

    # ---- the policy, as rank 0 exported it ------------------------------------------------------
    def export_packed(self, name: str = TRAIN_ADAPTER) -> tuple[Any, float]:
        """(ObjectRef[PackedTensors], scale) of rank 0's latest export: published unfetched."""
        ref, scale = self.exports[name]
        return ref[0], scale

    def export(self, name: str = TRAIN_ADAPTER) -> tuple[dict[str, torch.Tensor], float]:
        """The tensors themselves (fetched: a checkpoint, the evaluation EMA)."""
        ref, scale = self.export_packed(name)
        return ray.get(ref).unpack(), scale

    def on_learner(self, fn, *args):
        """fn(learner, *args) on rank 0 (on every rank under FSDP2, whose forwards gather the
        shards; rank 0's result). Module-level functions: they travel by reference."""
        sharded = self.kind is PolicyKind.FULL and self.world > 1
        payloads = [(fn, args)] * self.world if sharded else \
            [(fn, args)] + [None] * (self.world - 1)
        return self._call(Job.RUN, payloads)[0]

    def optimizer_state(self) -> dict:
        return ray.get(self._call(Job.STATE, [None] * self.world)[0][0])

    def load_state(self, adapters: Mapping[str, Mapping[str, torch.Tensor]],
                   optimizer: Mapping) -> None:
        ref = ray.put((dict(adapters), dict(optimizer)))
        self._call(Job.LOAD, [[ref]] * self.world)
        for name, tensors in adapters.items():     # the same tensors, at the same scale
            self.exports[name] = ([ray.put(PackedTensors.pack(dict(tensors)))],
                                  self.exports[name][1])

    def close(self) -> None:
        if self._thread.is_alive() and "error" not in self._result:
            try:
                self._call(Job.STOP, [None] * self.world, 120.0)
            finally:
                self._thread.join(120.0)


class LearnerEMA:
    """The evaluation EMA (run_state.PolicyEMA) kept on the learner -- rank 0 of a worker group
    -- beside the trained tensors it averages: the controller holds no copy of them; a
    checkpoint fetches them (`tensors`), the evaluation publishes them by reference."""

    def __init__(self, learners, cfg):
        self.learners, self.cfg = learners, cfg
        self.updates = 0
        self.started = False

    def update(self, step: int) -> None:
        self.updates = self.learners.on_learner(ema_update, self.cfg, step)
        self.started = True

    def packed_ref(self):
        """ObjectRef[PackedTensors] of the EMA now (None before its first update)."""
        ref = self.learners.on_learner(ema_export)
        return None if ref is None else ref[0]

    @property
    def tensors(self) -> dict[str, torch.Tensor] | None:
        ref = self.packed_ref()
        return None if ref is None else ray.get(ref).unpack()

    def restore(self, tensors: Mapping[str, torch.Tensor], updates: int) -> None:
        self.learners.on_learner(ema_restore, self.cfg, dict(tensors), int(updates))
        self.updates, self.started = int(updates), True


def build_learners(cfg, learner: Learner | None, graph, run_dir: Path,
                   probe: ConditionHandle | None = None):
    """learner: the in-process one (None beside a worker group)."""
    colocation = Colocation(graph.app_name if cfg.learner.placement is Placement.COLOCATED
                            else None)
    if cfg.learner.distributed:
        return RayTrainLearners(cfg, graph, run_dir, colocation, probe)
    return LocalLearners(cfg, learner, colocation, probe)


__all__ = ["Colocation", "LearnerEMA", "LocalLearners", "RayTrainLearners", "build_learners",
           "learner_worker"]
