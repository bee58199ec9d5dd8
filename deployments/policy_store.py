"""The policy store: a small named actor mapping LoRA version -> object ref of its tensors.

The trainer publishes each new LoRA once (`ray.put` + `publish`); rollout replicas load a version
on demand when a request names it, and new replicas start from the latest, so a sync reaches
every replica without broadcasting by hand. Refs are wrapped in a list so Ray passes them through
unresolved; tensors travel object store -> replica only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from contract import PolicyVersionError

NAMESPACE = "omni"
DEFAULT_KEEP = 8         # versions the store holds (older ones are dropped, memory freed)


@dataclass(frozen=True)
class PublishedPolicy:
    version: str
    step: int
    scale: float                 # LoRA scale (alpha / r) the slots apply
    tensors: list                # [ObjectRef[PackedTensors]] -- peft names, training side


@ray.remote(num_cpus=0)
class PolicyStore:
    def __init__(self, keep: int = DEFAULT_KEEP):
        self._keep = keep
        self._policies: dict[str, PublishedPolicy] = {}
        self._order: list[str] = []

    def publish(self, version: str, step: int, scale: float, tensors: list) -> int:
        if version in self._policies:
            raise PolicyVersionError("version already published", field="version",
                                     actual=version)
        self._policies[version] = PublishedPolicy(version, step, scale, tensors)
        self._order.append(version)
        while len(self._order) > self._keep:
            self._policies.pop(self._order.pop(0))
        return len(self._order)

    def get(self, version: str) -> PublishedPolicy:
        if version not in self._policies:
            raise PolicyVersionError("unknown policy version", field="policy_version",
                                     expected=list(self._order), actual=version)
        return self._policies[version]

    def latest(self) -> PublishedPolicy | None:
        return self._policies[self._order[-1]] if self._order else None

    def versions(self) -> list[str]:
        return list(self._order)


def get_policy_store(name: str, create: bool = True) -> Any:
    """The named store actor (created detached from any one caller when missing)."""
    if create:
        return PolicyStore.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                   lifetime="detached").remote()
    return ray.get_actor(name, namespace=NAMESPACE)
