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

Versions are namespaced per trainer run (`<run>/<name>`, the run given at publish): each run
keeps its own newest `keep` versions, so two trainers on one graph never evict each other's,
and at most `max_runs` runs are held (the one that published least recently goes first).
"Latest" is by training step, not by arrival (a restore re-registers older versions last): a
run's version of the highest step; without a run named, that of the run that published last.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.experimental import internal_kv

from contract import PolicyKind, PolicyVersionError, StageUnavailableError

NAMESPACE = "omni"
DEFAULT_KEEP = 8         # versions the store holds per run (older steps dropped, memory freed)
DEFAULT_MAX_RUNS = 4     # trainer runs whose versions the store holds


def run_of(version: str) -> str:
    """The run a version name belongs to: its prefix before the last '/' ('' for none)."""
    return version.rsplit("/", 1)[0] if "/" in version else ""


@dataclass(frozen=True)
class PublishedPolicy:
    version: str
    step: int
    scale: float                 # LoRA scale (alpha / r) the slots apply
    tensors: list                # [ObjectRef[PackedTensors]] -- peft names, training side
    kind: PolicyKind = PolicyKind.LORA   # LoRA tensors, or every transformer weight (full FT)

    @property
    def run(self) -> str:
        return run_of(self.version)


class PolicyVersions:
    """The store's bookkeeping (plain, so it is tested without an actor): versions per run,
    each run bounded to its `keep` highest steps, at most `max_runs` runs."""

    def __init__(self, keep: int = DEFAULT_KEEP, max_runs: int = DEFAULT_MAX_RUNS):
        self.keep, self.max_runs = keep, max_runs
        # run -> version -> (policy, arrival); runs ordered by their last publish
        self._runs: OrderedDict[str, dict[str, tuple[PublishedPolicy, int]]] = OrderedDict()
        self._arrivals = itertools.count()

    def __contains__(self, version: str) -> bool:
        return version in self._runs.get(run_of(version), {})

    def add(self, policy: PublishedPolicy, active: bool = True) -> list[str]:
        """Register a version; returns the versions dropped to stay within the bounds.
        active=False (a restore) leaves the run's place in the publish order as it was."""
        run = policy.run
        versions = self._runs.setdefault(run, {})
        versions[policy.version] = (policy, next(self._arrivals))
        if active:
            self._runs.move_to_end(run)
        dropped = []
        while len(versions) > self.keep:
            oldest = min(versions, key=lambda v: (versions[v][0].step, versions[v][1]))
            del versions[oldest]
            dropped.append(oldest)
        while len(self._runs) > self.max_runs:
            _, gone = self._runs.popitem(last=False)
            dropped.extend(gone)
        return dropped

    def replace(self, policy: PublishedPolicy) -> None:
        """Swap in another record of a held version (its adopted copy)."""
        versions = self._runs[policy.run]
        versions[policy.version] = (policy, versions[policy.version][1])

    def get(self, version: str) -> PublishedPolicy | None:
        entry = self._runs.get(run_of(version), {}).get(version)
        return None if entry is None else entry[0]

    def latest(self, run: str | None = None) -> str | None:
        """The version of the highest step (ties: the later arrival) of `run`, or of the run
        that published last."""
        if run is None:
            run = next(reversed(self._runs), None)
        versions = self._runs.get(run) if run is not None else None
        if not versions:
            return None
        return max(versions, key=lambda v: (versions[v][0].step, versions[v][1]))

    def versions(self, run: str | None = None) -> list[str]:
        """Held versions by step, per run in publish order (only `run`'s when given)."""
        runs = [run] if run is not None else list(self._runs)
        out = []
        for name in runs:
            versions = self._runs.get(name, {})
            out += sorted(versions, key=lambda v: (versions[v][0].step, versions[v][1]))
        return out


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyStore:
    def __init__(self, keep: int = DEFAULT_KEEP, max_runs: int = DEFAULT_MAX_RUNS):
        self._policies = PolicyVersions(keep, max_runs)
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
                self._policies.replace(dataclasses.replace(policy, tensors=[own]))
                self._adopted.add(version)

    def adopted(self) -> list[str]:
        """Versions whose tensors this store owns (they survive their publisher)."""
        with self._lock:
            return [v for v in self._policies.versions() if v in self._adopted]

    def incarnation(self) -> str:
        return self._incarnation

    def publish(self, version: str, step: int, scale: float, tensors: list,
                kind: PolicyKind = PolicyKind.LORA, run: str | None = None) -> str:
        """Register one version of `run` (None: the version's own prefix); returns this
        incarnation (a publisher seeing it change knows the store restarted since its last
        publish)."""
        if run is not None and run_of(version) != run:
            raise PolicyVersionError("a version is named inside its run's namespace",
                                     field="version", expected=f"{run}/<name>", actual=version)
        with self._lock:
            if version in self._policies:
                raise PolicyVersionError("version already published", field="version",
                                         actual=version)
            self._drop(self._policies.add(PublishedPolicy(version, step, scale, tensors,
                                                          PolicyKind(kind))))
        internal_kv._internal_kv_put(self._held_key, b"1", overwrite=True)
        self._adopter.submit(self._adopt, version)
        return self._incarnation

    def _drop(self, versions: Sequence[str]) -> None:
        self._adopted.difference_update(versions)

    def restore(self, policies: Sequence[PublishedPolicy]) -> str:
        """Re-register the versions a publisher holds after a restart; lookups are answered
        again from then on. Returns this incarnation."""
        with self._lock:
            missing = [p for p in policies if p.version not in self._policies]
            for p in missing:
                self._drop(self._policies.add(p, active=False))
            self._restored = True
        for p in missing:
            self._adopter.submit(self._adopt, p.version)
        return self._incarnation

    def _unavailable(self, field: str, version: str | None = None) -> StageUnavailableError:
        return StageUnavailableError("the policy store restarted and its versions are not "
                                     "restored yet; retry shortly", field=field, actual=version)

    def get(self, version: str) -> PublishedPolicy:
        with self._lock:
            policy = self._policies.get(version)
            if policy is None:
                if not self._restored:
                    raise self._unavailable("policy_store", version)
                raise PolicyVersionError("unknown policy version", field="policy_version",
                                         expected=self._policies.versions()[-16:],
                                         actual=version)
            return policy

    def latest_version(self, run: str | None = None) -> str | None:
        """The name only of `run`'s version of the highest step (None: of the run that
        published last); a reply without object refs in it: no borrower bookkeeping on the
        path of every request that asks for the latest policy."""
        with self._lock:
            if not self._restored:
                raise self._unavailable("policy_store")
            return self._policies.latest(run)

    def versions(self, run: str | None = None) -> list[str]:
        with self._lock:
            return self._policies.versions(run)


HEAD_NODE = {"node:__internal_head__": 0.001}    # a resource only Ray's head node has


def get_policy_store(name: str, create: bool = True) -> Any:
    """The named store actor (created detached from any one caller when missing), on the head
    node: a worker node's loss never takes the versions with it."""
    if create:
        return PolicyStore.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                   lifetime="detached", resources=HEAD_NODE).remote()
    return ray.get_actor(name, namespace=NAMESPACE)
