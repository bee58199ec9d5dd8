"""Publishing policy versions (LoRA adapters, or full weights of a full fine-tune) to the
rollout graph through the policy store.

Each version is packed into one contiguous buffer (contract.PackedTensors), `ray.put` once and
registered under a run-unique name (`<run>/v3`, `<run>/old-2`, `<run>/probe`); rollout replicas
fetch it on demand when a request names it. The trainer keeps views of the packed tensors of
recent versions so it can recompute log-probs at version parity. A version a learner worker
already put (an object ref to its PackedTensors, checked finite there) is registered as it is:
the trainer keeps the reference, and fetches the tensors only when asked (`tensors_of`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Mapping

import ray
import torch

from adapters.lora_files import nonfinite_keys
from contract import NonFiniteError, PackedTensors, PolicyKind, PolicyVersionError
from deployments.policy_store import PublishedPolicy, get_policy_store


class PolicyPublisher:
    def __init__(self, store_name: str, run_tag: str, keep: int = 8,
                 kind: PolicyKind = PolicyKind.LORA):
        self.store = get_policy_store(store_name, create=True)
        self.kind = PolicyKind(kind)              # LoRA adapters or full weights, every version
        self.run_tag = run_tag
        self.keep = keep
        self.tensors: "OrderedDict[str, dict[str, torch.Tensor]]" = OrderedDict()
        self.steps: dict[str, int] = {}
        self.scales: dict[str, float] = {}
        self._refs: "OrderedDict[str, object]" = OrderedDict()   # keep objects alive
        self.last_phases: dict[str, float] = {}           # pack_s / put_s / register_s
        self._incarnation: str | None = None      # of the store, as of the last publish
        self.restores = 0                         # times the store restarted and was restored

    def version(self, name: str) -> str:
        return f"{self.run_tag}/{name}"

    def publish(self, name: str, step: int,
                tensors: Mapping[str, torch.Tensor] | PackedTensors | ray.ObjectRef,
                scale: float) -> tuple[str, float]:
        """Put + register one version; returns (version, seconds spent). An ObjectRef (a
        learner worker's export) is registered without a fetch or a put."""
        t0 = time.perf_counter()
        version = self.version(name)
        if isinstance(tensors, ray.ObjectRef):
            return self._register(version, step, scale, tensors, None, t0, t0, t0)
        packed = (tensors if isinstance(tensors, PackedTensors)    # one buffer: one fetch
                  else PackedTensors.pack(tensors))
        bad = nonfinite_keys(packed.unpack())   # a NaN policy would fail every request
        if bad:
            raise NonFiniteError("the policy holds NaN or Inf; not published",
                                 field=f"policy[{bad[0]}]", expected="finite values",
                                 actual=f"{len(bad)} tensors", request_id=version)
        t1 = time.perf_counter()
        ref = ray.put(packed)
        return self._register(version, step, scale, ref, packed.unpack(), t0, t1,
                              time.perf_counter())

    def _register(self, version: str, step: int, scale: float, ref, tensors, t0: float,
                  t1: float, t2: float) -> tuple[str, float]:
        incarnation = ray.get(self.store.publish.remote(version, step, scale, [ref], self.kind,
                                                        self.run_tag))
        self.last_phases = {"pack_s": t1 - t0, "put_s": t2 - t1,
                            "register_s": time.perf_counter() - t2}
        self.tensors[version] = tensors     # the published snapshot (None: fetched on demand)
        self.steps[version] = step
        self.scales[version] = scale
        self._refs[version] = ref
        while len(self.tensors) > self.keep:
            old, _ = self.tensors.popitem(last=False)
            self._refs.pop(old, None)
            self.steps.pop(old, None)
            self.scales.pop(old, None)
        if self._incarnation is not None and incarnation != self._incarnation:
            self._restore()                 # the store restarted since the last publish
        self._incarnation = incarnation
        return version, time.perf_counter() - t0

    def ensure_store(self) -> bool:
        """If the store restarted since the last publish (it came back empty), register again
        every version this publisher holds; True when it did. The trainer calls this at each
        step and before resubmitting rollouts that failed as retryable."""
        if self._incarnation is None:
            return False
        if ray.get(self.store.incarnation.remote()) == self._incarnation:
            return False
        self._restore()
        return True

    def _restore(self) -> None:
        held = [PublishedPolicy(v, self.steps[v], self.scales[v], [self._refs[v]], self.kind)
                for v in self._refs]
        self._incarnation = ray.get(self.store.restore.remote(held))
        self.restores += 1

    def tensors_of(self, version: str) -> dict[str, torch.Tensor]:
        if version not in self.tensors:
            raise PolicyVersionError("the trainer no longer holds this version's tensors",
                                     field="policy_version", expected=list(self.tensors),
                                     actual=version)
        held = self.tensors[version]
        return held if held is not None else ray.get(self._refs[version]).unpack()

    def ref_of(self, version: str):
        """The object ref of a version this publisher holds (a learner fetches it itself)."""
        if version not in self._refs:
            raise PolicyVersionError("the trainer no longer holds this version",
                                     field="policy_version", expected=list(self._refs),
                                     actual=version)
        return self._refs[version]
