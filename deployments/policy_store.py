"""The policy store: a small named actor mapping LoRA version -> object ref of its tensors.

The trainer publishes each new LoRA once (`ray.put` + `publish`); rollout replicas load a version
on demand when a request names it, and new replicas start from the latest, so a sync reaches
every replica without broadcasting by hand. Refs are wrapped in a list so Ray passes them through
unresolved; tensors travel object store -> replica only.

The store survives its own death: Ray restarts it (max_restarts=-1) and retries calls made
meanwhile (max_task_retries=-1). A restarted store is empty and says so -- `get` of a version it
no longer holds and `latest` raise StageUnavailableError (503, retryable), never "no version" --
until the trainer, which owns the tensors (its `ray.put`), restores what it holds
(trainer/sync.py, `PolicyPublisher.ensure_store`; `incarnation` tells it the store restarted).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from contract import PolicyVersionError, StageUnavailableError

NAMESPACE = "omni"
DEFAULT_KEEP = 8         # versions the store holds (older ones are dropped, memory freed)


@dataclass(frozen=True)
class PublishedPolicy:
    version: str
    step: int
    scale: float                 # LoRA scale (alpha / r) the slots apply
    tensors: list                # [ObjectRef[PackedTensors]] -- peft names, training side


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyStore:
    def __init__(self, keep: int = DEFAULT_KEEP):
        self._keep = keep
        self._policies: dict[str, PublishedPolicy] = {}
        self._order: list[str] = []
        self._incarnation = uuid.uuid4().hex          # new at every (re)start
        # a restarted store lost its versions: refuse lookups until the trainer restores them
        self._restored = not ray.get_runtime_context().was_current_actor_reconstructed

    def incarnation(self) -> str:
        return self._incarnation

    def publish(self, version: str, step: int, scale: float, tensors: list) -> str:
        """Register one version; returns this incarnation (a publisher seeing it change knows
        the store restarted since its last publish)."""
        if version in self._policies:
            raise PolicyVersionError("version already published", field="version",
                                     actual=version)
        self._policies[version] = PublishedPolicy(version, step, scale, tensors)
        self._order.append(version)
        while len(self._order) > self._keep:
            self._policies.pop(self._order.pop(0))
        return self._incarnation

    def restore(self, policies: Sequence[PublishedPolicy]) -> str:
        """Re-register the versions a publisher holds (oldest first) after a restart; lookups
        are answered again from then on. Returns this incarnation."""
        missing = [p for p in policies if p.version not in self._policies]
        self._policies.update({p.version: p for p in missing})
        self._order = [p.version for p in missing] + self._order     # restored ones are older
        while len(self._order) > self._keep:
            self._policies.pop(self._order.pop(0))
        self._restored = True
        return self._incarnation

    def _unavailable(self, field: str, version: str | None = None) -> StageUnavailableError:
        return StageUnavailableError("the policy store restarted and its versions are not "
                                     "restored yet; retry shortly", field=field, actual=version)

    def get(self, version: str) -> PublishedPolicy:
        if version not in self._policies:
            if not self._restored:
                raise self._unavailable("policy_store", version)
            raise PolicyVersionError("unknown policy version", field="policy_version",
                                     expected=list(self._order), actual=version)
        return self._policies[version]

    def latest(self) -> PublishedPolicy | None:
        if not self._restored:
            raise self._unavailable("policy_store")
        return self._policies[self._order[-1]] if self._order else None

    def versions(self) -> list[str]:
        return list(self._order)


HEAD_NODE = {"node:__internal_head__": 0.001}    # a resource only Ray's head node has


def get_policy_store(name: str, create: bool = True) -> Any:
    """The named store actor (created detached from any one caller when missing), on the head
    node: a worker node's loss never takes the versions with it."""
    if create:
        return PolicyStore.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                   lifetime="detached", resources=HEAD_NODE).remote()
    return ray.get_actor(name, namespace=NAMESPACE)
