"""Where the learner's step runs: in the trainer process, or on a Ray Train worker group.

    learners = build_learners(cfg, learner, graph, run_dir)   # LocalLearners | RayTrainLearners
    metrics = learners.update(batch, gen)         # one optimizer step on the whole batch
    learners.refresh_old(decay); learners.optimizer_state(); learners.load_state(...)

The trainer process is the controller (rollouts through handles, advantages, publishing,
evaluation, checkpoints) and keeps a `Learner` of its own for conditions, start-up checks,
log-prob parity and the weights it publishes. With `learner.workers = N`, N Ray Train workers
(`ray.train.torch.TorchTrainer`, one process group, gloo on CPU / nccl on GPU) each hold the
model and train their shard of the prompt groups (`updates.shard_plan`); the controller's
learner then mirrors rank 0's exported weights after every step. The interface is small:
a plan shard in, metrics + exported weights (one PackedTensors object) out; the worker's side
of it is trainer/learner_worker.py.

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

from contract import Algorithm, PolicyKind, StageUnavailableError
from trainer.learner import Learner
from trainer.learner_config import LearnerConfig, Placement
from trainer.learner_worker import Job, LearnerChannel, learner_worker
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.updates import Batch, plan_update, run_update, shard_plan

START_TIMEOUT_S = 900.0          # the worker group's start: processes, model loads


def controller_settings(learner: LearnerConfig) -> LearnerConfig:
    """The controller's own learner: as configured when it trains in-process; beside a worker
    group a CPU copy for conditions, checks, parity and exports (no GPU of the workers')."""
    if not learner.distributed:
        return learner
    dtype = learner.dtype if learner.torch_dtype != torch.float16 else "float32"
    return learner.model_copy(update={"device": "cpu", "dtype": dtype,
                                      "gradient_checkpointing": False})


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
    """The learner in the trainer process."""

    def __init__(self, cfg, learner: Learner, colocation: Colocation):
        self.cfg, self.learner, self.colocation = cfg, learner, colocation

    def update(self, batch: Batch, gen: torch.Generator, algorithm: Algorithm | None = None,
               old_version: str | None = None) -> dict[str, float]:
        """One step here; old_version: the learner's published pre-step version (FlowGRPO)."""
        plan = plan_update(algorithm or self.cfg.algorithm, batch, self.cfg, gen, old_version)
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
    `fit()` runs in a thread; each worker serves jobs from the channel until STOP."""

    def __init__(self, cfg, learner: Learner, graph, run_dir: Path, colocation: Colocation):
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        self.cfg, self.learner, self.colocation = cfg, learner, colocation
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
        replies = self._call(Job.START, [None] * self.world, START_TIMEOUT_S)
        # what each worker holds (its bundle), and the workers' initial weights
        self.worker_resources = [replies[r]["resources"] for r in range(self.world)]
        for name, ref in replies[0]["exports"].items():
            self.learner.load_adapter(name, ray.get(ref[0]).unpack())

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
            self.learner.load_adapter(TRAIN_ADAPTER, ray.get(reply["export"][0]).unpack())
        return reply["metrics"]

    def refresh_old(self, decay: float) -> None:
        reply = self._call(Job.REFRESH, [decay] * self.world)[0]
        self.learner.load_adapter(OLD_ADAPTER, ray.get(reply[0]).unpack())

    def optimizer_state(self) -> dict:
        return ray.get(self._call(Job.STATE, [None] * self.world)[0][0])

    def load_state(self, adapters: Mapping[str, Mapping[str, torch.Tensor]],
                   optimizer: Mapping) -> None:
        ref = ray.put((dict(adapters), dict(optimizer)))
        self._call(Job.LOAD, [[ref]] * self.world)

    def close(self) -> None:
        if self._thread.is_alive() and "error" not in self._result:
            try:
                self._call(Job.STOP, [None] * self.world, 120.0)
            finally:
                self._thread.join(120.0)


def build_learners(cfg, learner: Learner, graph, run_dir: Path):
    colocation = Colocation(graph.app_name if cfg.learner.placement is Placement.COLOCATED
                            else None)
    if cfg.learner.distributed:
        return RayTrainLearners(cfg, learner, graph, run_dir, colocation)
    return LocalLearners(cfg, learner, colocation)


__all__ = ["Colocation", "LocalLearners", "RayTrainLearners", "build_learners",
           "controller_settings", "learner_worker"]
