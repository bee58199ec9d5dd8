"""Stage outputs in the object store, kept alive until their consumers have fetched them.

A stage's output travels on as an ObjectRef through Serve (ingress, decoders, scorers, the
caller), and Serve's transport does not always register those holders as borrowers with the
owner, so an owner could free an object a consumer is about to fetch ("object already deleted by
the reference counting protocol"). Each stage therefore keeps a strong reference to what it put,
keyed by (request id, artifact name), until the object's consumers have it:

    the ingress releases what only the graph's own stages read (latents the decoders fetched,
    decoded media the scorers scored) as soon as the request is scored, and everything of an
    HTTP request once its answer is built; the caller's client releases the rest once it has
    fetched the tensors (deployments/client.py). A caller that never releases is bounded by
    `ttl_s` and `max_objects`.

With several replicas per stage a release must reach whoever holds the reference, which a
Serve call cannot address to one replica; so a stage hands its references to the graph's one
`ObjectHolder` actor (a named detached actor on the head node, like the policy store) in a
plain actor call, which registers the holder as a borrower, and keeps none itself: the holder is
the one place that keeps and releases them. The putting replica stays the objects' owner (their
bytes stay in its node's store; if it dies they are lost, a retryable ReplicaFailedError for
the consumer). Without a holder (`ObjectKeeper(holder=None)`) a keeper holds its own puts
(tests, a process outside the graph).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray

from contract import ArtifactHandle, MediaArtifact

TRAJECTORY = "trajectory"            # the name a rollout's trajectory is held under
NAMESPACE = "omni"
DEFAULT_TTL_S = 600.0                # GraphConfig.objects' defaults
DEFAULT_MAX_OBJECTS = 65536


class HeldRefs:
    """References held by (request id, name), oldest first, bounded by age and count; ages
    read from `clock` (seconds, monotonic)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_objects, self.clock = ttl_s, max_objects, clock
        self._refs: deque[tuple[float, str | None, str | None, Any]] = deque()
        self._lock = threading.Lock()

    def add(self, request_id: str | None, name: str | None, refs: Iterable[Any]) -> None:
        now = self.clock()
        with self._lock:
            self._refs.extend((now, request_id, name, ref) for ref in refs)
            while self._refs and (len(self._refs) > self.max_objects or
                                  now - self._refs[0][0] > self.ttl_s):
                self._refs.popleft()

    def release(self, request_ids: Iterable[str], names: Iterable[str] | None = None) -> int:
        """Drop the references of these requests (only `names`, when given); returns how many."""
        ids, wanted = set(request_ids), None if names is None else set(names)
        with self._lock:
            kept = deque(e for e in self._refs if e[1] not in ids or
                         (wanted is not None and e[2] not in wanted))
            dropped = len(self._refs) - len(kept)
            self._refs = kept
        return dropped

    def __len__(self) -> int:
        return len(self._refs)


class ObjectHolder:
    """The one holder of the graph's stage outputs (a Ray actor body)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 clock: Callable[[], float] = time.monotonic):
        self.held = HeldRefs(ttl_s, max_objects, clock)

    def hold(self, request_id: str | None, names: list[str | None], refs: list) -> int:
        """One request's puts of one stage call, named; the refs arrive in a list (borrowed,
        tracked, never fetched)."""
        for name, ref in zip(names, refs, strict=True):
            self.held.add(request_id, name, [ref])
        return len(self.held)

    def release(self, request_ids: list[str], names: list[str] | None = None) -> int:
        return self.held.release(request_ids, names)

    def configure(self, ttl_s: float, max_objects: int) -> None:
        """The graph's bounds (GraphConfig.objects), for a holder that outlived a deployment."""
        self.held.ttl_s, self.held.max_objects = ttl_s, max_objects

    def bounds(self) -> tuple[float, int]:
        return self.held.ttl_s, self.held.max_objects

    def count(self) -> int:
        return len(self.held)


@dataclass(frozen=True)
class HolderSpec:
    """Which holder actor a graph's stages hand their outputs to, and its bounds
    (GraphConfig.objects: how long and how many references a caller that never releases pins)."""

    name: str
    ttl_s: float = DEFAULT_TTL_S
    max_objects: int = DEFAULT_MAX_OBJECTS


def get_object_holder(spec: HolderSpec | str, create: bool = True) -> Any:
    """The named holder actor (created detached on the head node when missing, with the spec's
    bounds; one already running takes them too, so a redeployed graph's bounds hold)."""
    spec = spec if isinstance(spec, HolderSpec) else HolderSpec(spec)
    if not create:
        return ray.get_actor(spec.name, namespace=NAMESPACE)
    holder = ray.remote(ObjectHolder).options(
        name=spec.name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, resources={"node:__internal_head__": 0.001}).remote(spec.ttl_s,
                                                                        spec.max_objects)
    holder.configure.remote(spec.ttl_s, spec.max_objects)
    return holder


class ObjectKeeper:
    """What a stage replica puts: into the object store, held by the graph's holder actor
    (or, without one, by this keeper) until released or for at most ttl_s."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 holder: Any | None = None, clock: Callable[[], float] = time.monotonic):
        self.holder = holder
        self.local = HeldRefs(ttl_s, max_objects, clock)
        # request id -> [(name, ref)] put but not yet handed to the holder (held here till then)
        self._pending: dict[str | None, list[tuple[str | None, Any]]] = {}

    def put(self, value: Any, request_id: str | None = None, name: str | None = None) -> Any:
        ref = ray.put(value)
        if self.holder is None:
            self.local.add(request_id, name, [ref])
        else:
            self._pending.setdefault(request_id, []).append((name, ref))
        return ref

    async def settled(self, request_id: str | None) -> None:
        """Hand this request's puts to the holder in one actor call and wait until it holds
        them (before the outputs leave the stage, so no release can overtake a hold)."""
        named = self._pending.pop(request_id, [])
        if named:
            await self.holder.hold.remote(request_id, [n for n, _ in named],
                                          [r for _, r in named])

    def release(self, request_ids: Iterable[str], names: Iterable[str] | None = None) -> int:
        return self.local.release(request_ids, names)

    def __len__(self) -> int:
        return len(self.local)

    def put_artifact(self, artifact: MediaArtifact,
                     request_id: str | None = None) -> ArtifactHandle:
        """Object-store an artifact; return the small handle the graph moves around."""
        return ArtifactHandle(spec=artifact.spec, shape=tuple(artifact.data.shape),
                              dtype=str(artifact.data.dtype).replace("torch.", ""),
                              ref=self.put(artifact, request_id, artifact.name),
                              metadata=dict(artifact.metadata))


def holder_name(app_name: str) -> str:
    """The ObjectHolder actor of a graph (one per Serve application)."""
    return f"{app_name}_objects"
