"""DiTRollout stage: wraps the rollout strategy (one engine loop per replica) and its LoRA slots.

A request names the policy version to sample with; a version that is not resident is fetched on
demand from the policy store (deployments/policy_store.py). New replicas start from the latest
published version. Outputs leave as object-store handles (contract.transport), never inline.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Mapping, Sequence

import torch
from ray.exceptions import ObjectLostError

from contract import (Condition, PolicyKind, PolicyVersionError, RequestLimits, RolloutRequest,
                      StageOutput)
from deployments.memory import guard_replica_memory
from deployments.metrics import StageMetrics
from deployments.objects import TRAJECTORY, HolderShards, HolderSpec, ObjectKeeper
from deployments.policy_store import get_policy_store
from rollout.config import RolloutConfig
from rollout.strategy import build_strategy

BASE_VERSION = "base"


def seen_token_ids(cond: Condition, negative: Condition | None) -> dict[str, tuple[int, ...]]:
    """The ids the encoder stage reported for this request, per encoder."""
    seen = dict(cond.token_ids[0]) if cond.token_ids else {}
    if negative is not None and negative.token_ids:
        seen.update({f"negative/{k}": v for k, v in negative.token_ids[0].items()})
    return seen


class KeyedLocks:
    """One asyncio.Lock per key while some call holds or waits for it: an entry goes with its
    last user, so the map is bounded by the calls in flight, not by every distinct key (policy
    version string) a client ever sent. One event loop uses it (no thread locking)."""

    def __init__(self):
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str):
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class DiTRolloutServer:
    def __init__(self, rollout: RolloutConfig, policy_store: str, limits: RequestLimits,
                 objects: HolderSpec | None = None):
        """objects: the graph's ObjectHolder actor and its bounds (None: this replica holds
        its puts)."""
        self.memory_guard = guard_replica_memory("DiTRollout")
        strategy = build_strategy(rollout, limits)     # the graph's limits, as the ingress's
        self.strategy = strategy
        self.engine = strategy.engine
        self.store = get_policy_store(policy_store)
        self.metrics = StageMetrics("rollout")
        self.objects = ObjectKeeper(holder=None if objects is None else HolderShards(objects))
        self._locks = KeyedLocks()                  # one per version being loaded
        self.load_seconds: dict[str, dict[str, float]] = {}   # version -> phase -> s

    async def _ensure(self, version: str) -> str:
        if version == BASE_VERSION or version in self.engine.versions():
            return version
        async with self._locks.hold(version):
            if version not in self.engine.versions():
                t0 = time.perf_counter()
                policy = await self.store.get.remote(version)
                t1 = time.perf_counter()
                try:
                    tensors = (await policy.tensors[0]).unpack()    # views into one buffer
                except ObjectLostError as exc:    # not a replica death: the version is gone
                    raise PolicyVersionError("the tensors of this version are lost (their "
                                             "publisher exited before the store kept a copy)",
                                             field="policy_version", actual=version) from exc
                t2 = time.perf_counter()
                # the fetched buffer belongs to this replica alone: keep views, no copy
                if policy.kind is PolicyKind.FULL:       # every weight (a full fine-tune)
                    load_full = getattr(self.engine, "load_full", None)
                    if load_full is None:
                        raise PolicyVersionError("this engine cannot hold full-weight versions",
                                                 field="policy_version", actual=version)
                    await asyncio.to_thread(load_full, version, tensors, False)
                else:
                    await asyncio.to_thread(self.engine.load_lora, version, tensors,
                                            policy.scale, False)
                self.load_seconds[version] = {"store_get_s": t1 - t0, "fetch_s": t2 - t1,
                                              "load_s": time.perf_counter() - t2}
                while len(self.load_seconds) > 16:
                    self.load_seconds.pop(next(iter(self.load_seconds)))
        return version

    async def _resolve(self, requested: str | None) -> str:
        if requested is not None:
            return await self._ensure(requested)
        latest = await self.store.latest_version.remote()
        return await self._ensure(latest if latest is not None else BASE_VERSION)

    async def rollout(self, request: RolloutRequest, cond: Condition,
                      requested: Sequence[str], negative: Condition | None = None
                      ) -> StageOutput:
        t0 = time.perf_counter()
        version = await self._resolve(request.policy_version)
        request = dataclasses.replace(request, policy_version=version,
                                      requested_artifacts=tuple(requested))
        with self.metrics.track(request.output_rows):
            out = await self.strategy.generate(request, cond, negative)
        rid = out.request_id
        handles = {name: self.objects.put_artifact(a, rid) for name, a in out.artifacts.items()}
        trajectory = self.objects.put(out.trajectory, rid, TRAJECTORY)
        await self.objects.settled(rid)
        return StageOutput(request_id=rid, artifacts=handles,
                           policy_version=out.policy_version, seeds=out.seeds,
                           stop_reason=out.stop_reason, trajectory=trajectory,
                           metrics={**out.metrics, "rollout_stage_s": time.perf_counter() - t0,
                                    "rollout_replica_pid": float(os.getpid())},
                           encoded_token_ids=seen_token_ids(cond, negative),
                           sampling=self.strategy.family.sampling_as_run(request.sampling),
                           tree=out.tree)

    async def load_lora(self, version: str, tensors: Mapping[str, torch.Tensor],
                        scale: float = 1.0) -> tuple[str, ...]:
        if version == BASE_VERSION:
            raise PolicyVersionError("'base' is the model without LoRA", field="version",
                                     actual=version)
        await asyncio.to_thread(self.engine.load_lora, version, tensors, scale, False)
        return self.engine.versions()

    async def ensure_version(self, version: str) -> tuple[str, ...]:
        """Load `version` from the policy store now (a trainer may pre-warm replicas)."""
        await self._ensure(version)
        return self.engine.versions()

    async def ensure_version_on_replica(self, version: str
                                        ) -> tuple[int, tuple[str, ...], dict[str, float]]:
        """`ensure_version` plus this replica's pid and the seconds its load of `version` took
        per phase (empty if it was already resident), so a caller can tell when a version is
        live on every replica and where the time went (the sync benchmark)."""
        await self._ensure(version)
        return os.getpid(), self.engine.versions(), self.load_seconds.get(version, {})

    async def versions(self) -> tuple[str, ...]:
        return self.engine.versions()

    async def sleep(self, level: int = 1) -> int:
        """Colocated learners step now: the engine pauses (vLLM-Omni level 1 also frees its
        weights and cache) until `wake_up`. Returns this replica's pid."""
        await self.engine.sleep(level)
        return os.getpid()

    async def wake_up(self) -> int:
        await self.engine.wake_up()
        return os.getpid()

    async def pid(self) -> int:
        return os.getpid()
