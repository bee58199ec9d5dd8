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
Serve call cannot address to one replica; so a stage hands its references to the graph's
`ObjectHolder` actors (named detached actors on the head node, like the policy store) in a
plain actor call, which registers the holder as a borrower, and keeps none itself: the holder is
the one place that keeps and releases them. There are `objects.shards` of them
(`HolderShards`): a request's references live on the shard its id hashes to, so every stage,
ingress replica and client finds them there without asking, and the load of holding and
releasing spreads over the shards; within a shard, holding, evicting and releasing cost O(1)
per reference (`HeldRefs`). The putting replica stays the objects' owner (their
bytes stay in its node's store; if it dies they are lost, a retryable ReplicaFailedError for
the consumer). Without a holder (`ObjectKeeper(holder=None)`) a keeper holds its own puts
(tests, a process outside the graph).
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable


from contract import ArtifactHandle, MediaArtifact

TRAJECTORY = "trajectory"            # the name a rollout's trajectory is held under
NAMESPACE = "omni"
DEFAULT_TTL_S = 600.0                # GraphConfig.objects' defaults
DEFAULT_MAX_OBJECTS = 65536


class HeldRefs:
    """References held by (request id, name), oldest first, bounded by age and count; ages
    read from `clock` (seconds, monotonic).

    Entries live in one insertion-ordered map (oldest first: the age / count bound pops its
    head) and are indexed by request id and name, so holding, evicting and releasing cost O(1)
    per reference, whatever else is held."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_objects, self.clock = ttl_s, max_objects, clock
        self._refs: OrderedDict[int, tuple[float, str | None, str | None, Any]] = OrderedDict()
        self._index: dict[str | None, dict[str | None, list[int]]] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def add(self, request_id: str | None, name: str | None, refs: Iterable[Any]) -> None:
        now = self.clock()
        with self._lock:
            names = self._index.setdefault(request_id, {})
            for ref in refs:
                seq = next(self._seq)
                self._refs[seq] = (now, request_id, name, ref)
                names.setdefault(name, []).append(seq)
            while self._refs and (len(self._refs) > self.max_objects or
                                  now - next(iter(self._refs.values()))[0] > self.ttl_s):
                _, (_, rid, held_name, _) = self._refs.popitem(last=False)
                self._unindex(rid, held_name)

    def _unindex(self, request_id: str | None, name: str | None) -> None:
        """The index entry of the oldest reference of (request id, name), just evicted."""
        names = self._index[request_id]
        seqs = names[name]
        seqs.pop(0)                     # a name's references are in age order: its oldest
        if not seqs:
            del names[name]
            if not names:
                del self._index[request_id]

    def release(self, request_ids: Iterable[str], names: Iterable[str] | None = None) -> int:
        """Drop the references of these requests (only `names`, when given); returns how many."""
        dropped = 0
        with self._lock:
            for request_id in request_ids:
                held = self._index.get(request_id)
                if held is None:
                    continue
                for name in list(held) if names is None else names:
                    for seq in held.pop(name, ()):
                        del self._refs[seq]
                        dropped += 1
                if not held:
                    del self._index[request_id]
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
    shards: int = 1                  # holder actors; a request's references on one of them


def shard_of(request_id: str | None, shards: int) -> int:
    """The holder shard of a request: a digest of its id, the same in every process."""
    if shards == 1:
        return 0
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


def shard_name(name: str, shard: int) -> str:
    """Shard 0 keeps the graph's holder name; the others add their index."""
    return name if shard == 0 else f"{name}_{shard}"


class HolderShards:
    """The graph's holder actors (`spec.shards` of them): each request's references live on the
    shard of its id, so holds and releases spread over the shards, one actor call per shard
    touched; each shard holds at most its share of `max_objects`."""

    def __init__(self, spec: HolderSpec | str, create: bool = True):
        spec = spec if isinstance(spec, HolderSpec) else HolderSpec(spec)
        share = -(-spec.max_objects // spec.shards)
        self.actors = [get_object_holder(HolderSpec(shard_name(spec.name, i), spec.ttl_s, share),
                                         create) for i in range(spec.shards)]

    def of(self, request_id: str | None) -> Any:
        return self.actors[shard_of(request_id, len(self.actors))]

    async def hold(self, request_id: str | None, names: list[str | None], refs: list) -> int:
        return await self.of(request_id).hold.remote(request_id, names, refs)

    async def release(self, request_ids: Iterable[str],
                      names: Iterable[str] | None = None) -> int:
        """Drop these requests' references (only `names`, when given); returns how many."""
        by_shard: dict[int, list[str]] = {}
        for request_id in request_ids:
            by_shard.setdefault(shard_of(request_id, len(self.actors)), []).append(request_id)
        names = None if names is None else list(names)
        counts = await asyncio.gather(*(self.actors[i].release.remote(ids, names)
                                        for i, ids in by_shard.items()))
        return sum(counts)

    async def count(self) -> int:
        return sum(await asyncio.gather(*(a.count.remote() for a in self.actors)))


def get_object_holder(spec: HolderSpec | str, create: bool = True) -> Any:
    """The named holder actor (created detached on the head node when missing, with the spec's
    bounds; one already running takes them too, so a redeployed graph's bounds hold)."""
    import ray                       # here, not at module level: GraphConfig reads this module

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
                 holder: HolderShards | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.holder = holder
        self.local = HeldRefs(ttl_s, max_objects, clock)
        # request id -> [(name, ref)] put but not yet handed to the holder (held here till then)
        self._pending: dict[str | None, list[tuple[str | None, Any]]] = {}

    def put(self, value: Any, request_id: str | None = None, name: str | None = None) -> Any:
        import ray

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
            await self.holder.hold(request_id, [n for n, _ in named], [r for _, r in named])

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
