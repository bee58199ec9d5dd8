"""The policy store: a small named actor mapping LoRA version -> object ref of its tensors.

The trainer publishes each new LoRA once (`ray.put` + `publish`); rollout replicas load a version
on demand when a request names it, and new replicas start from the latest, so a sync reaches
every replica without broadcasting by hand. Refs are wrapped in a list so Ray passes them through
unresolved; tensors travel object store -> replica only.

The trainer's `ray.put` owns each version's object, and Ray frees an object when its owner
exits; so the store adopts every version in the background -- one copy it owns, swapped in for the
publisher's ref -- and the versions outlive the trainer (a graph keeps serving the trained policy
after training ends, and a replica started later still finds it).

The store survives its own death: Ray restarts it (max_restarts=-1) and retries calls made
meanwhile (max_task_retries=-1). A restarted store is empty and says so -- `get` of a version it
no longer holds and `latest` raise StageUnavailableError (503, retryable), never "no version" --
until the trainer, which owns the tensors (its `ray.put`), restores what it holds
(trainer/sync.py, `PolicyPublisher.ensure_store`; `incarnation` tells it the store restarted).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.experimental import internal_kv

from contract import PolicyKind, PolicyVersionError, StageUnavailableError

NAMESPACE = "omni"
DEFAULT_KEEP = 8         # versions the store holds (older ones are dropped, memory freed)


@dataclass(frozen=True)
class PublishedPolicy:
    version: str
    step: int
    scale: float                 # LoRA scale (alpha / r) the slots apply
    tensors: list                # [ObjectRef[PackedTensors]] -- peft names, training side
    kind: PolicyKind = PolicyKind.LORA   # LoRA tensors, or every transformer weight (full FT)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyStore:
    def __init__(self, keep: int = DEFAULT_KEEP):
        self._keep = keep
        self._policies: dict[str, PublishedPolicy] = {}
        self._order: list[str] = []
        self._incarnation = uuid.uuid4().hex          # new at every (re)start
        # A restarted store lost its versions: refuse lookups until the trainer restores them.
        # Whether there were any is kept in the GCS (it outlives the actor): a store that had
        # none is simply empty after a restart.
        context = ray.get_runtime_context()
        self._held_key = f"omni_policy_store:{context.get_actor_name()}:held".encode()
        self._restored = not (context.was_current_actor_reconstructed and
                              internal_kv._internal_kv_exists(self._held_key))
        self._lock = threading.Lock()                 # the adopting thread swaps refs
        self._adopter = concurrent.futures.ThreadPoolExecutor(1, "adopt")
        self._adopted: set[str] = set()

    def _adopt(self, version: str) -> None:
        """Copy a version's tensors into an object this store owns (background thread)."""
        with self._lock:
            policy = self._policies.get(version)
        if policy is None:
            return
        value = ray.get(policy.tensors[0])
        own = ray.put(value)
        del value
        with self._lock:
            if self._policies.get(version) is policy:
                self._policies[version] = dataclasses.replace(policy, tensors=[own])
                self._adopted.add(version)

    def adopted(self) -> list[str]:
        """Versions whose tensors this store owns (they survive their publisher)."""
        with self._lock:
            return [v for v in self._order if v in self._adopted]

    def incarnation(self) -> str:
        return self._incarnation

    def publish(self, version: str, step: int, scale: float, tensors: list,
                kind: PolicyKind = PolicyKind.LORA) -> str:
        """Register one version; returns this incarnation (a publisher seeing it change knows
        the store restarted since its last publish)."""
        with self._lock:
            if version in self._policies:
                raise PolicyVersionError("version already published", field="version",
                                         actual=version)
            self._policies[version] = PublishedPolicy(version, step, scale, tensors,
                                                      PolicyKind(kind))
            self._order.append(version)
            self._trim()
        internal_kv._internal_kv_put(self._held_key, b"1", overwrite=True)
        self._adopter.submit(self._adopt, version)
        return self._incarnation

    def _trim(self) -> None:
        while len(self._order) > self._keep:
            old = self._order.pop(0)
            self._policies.pop(old)
            self._adopted.discard(old)

    def restore(self, policies: Sequence[PublishedPolicy]) -> str:
        """Re-register the versions a publisher holds (oldest first) after a restart; lookups
        are answered again from then on. Returns this incarnation."""
        with self._lock:
            missing = [p for p in policies if p.version not in self._policies]
            self._policies.update({p.version: p for p in missing})
            self._order = [p.version for p in missing] + self._order   # restored ones are older
            self._trim()
            self._restored = True
        for p in missing:
            self._adopter.submit(self._adopt, p.version)
        return self._incarnation

    def _unavailable(self, field: str, version: str | None = None) -> StageUnavailableError:
        return StageUnavailableError("the policy store restarted and its versions are not "
                                     "restored yet; retry shortly", field=field, actual=version)

    def get(self, version: str) -> PublishedPolicy:
        with self._lock:
            if version not in self._policies:
                if not self._restored:
                    raise self._unavailable("policy_store", version)
                raise PolicyVersionError("unknown policy version", field="policy_version",
                                         expected=list(self._order), actual=version)
            return self._policies[version]

    def latest_version(self) -> str | None:
        """The newest version's name only (a reply without object refs in it: no borrower
        bookkeeping on the path of every request that asks for the latest policy)."""
        with self._lock:
            if not self._restored:
                raise self._unavailable("policy_store")
            return self._order[-1] if self._order else None

    def versions(self) -> list[str]:
        with self._lock:
            return list(self._order)


HEAD_NODE = {"node:__internal_head__": 0.001}    # a resource only Ray's head node has


def get_policy_store(name: str, create: bool = True) -> Any:
    """The named store actor (created detached from any one caller when missing), on the head
    node: a worker node's loss never takes the versions with it."""
    if create:
        return PolicyStore.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                   lifetime="detached", resources=HEAD_NODE).remote()
    return ray.get_actor(name, namespace=NAMESPACE)
