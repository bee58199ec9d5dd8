"""Stage outputs in the object store, kept alive at their owner until consumers have them.

A replica that `ray.put`s an artifact owns it. The handle travels on through Serve (ingress,
decoders, scorers, the caller), and Serve's transport does not always register those holders as
borrowers with the owner, so the owner could free an object that a consumer is about to fetch
("object already deleted by the reference counting protocol"). `ObjectKeeper` holds a strong
reference to every object a stage put for `ttl_s` seconds (bounded by count), which covers the
graph's own hops and a caller fetching its results.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import ray

from contract import ArtifactHandle, MediaArtifact


class ObjectKeeper:
    def __init__(self, ttl_s: float = 600.0, max_objects: int = 65536):
        self.ttl_s, self.max_objects = ttl_s, max_objects
        self._refs: deque[tuple[float, Any]] = deque()
        self._lock = threading.Lock()

    def put(self, value: Any) -> Any:
        ref = ray.put(value)
        now = time.monotonic()
        with self._lock:
            self._refs.append((now, ref))
            while self._refs and (len(self._refs) > self.max_objects or
                                  now - self._refs[0][0] > self.ttl_s):
                self._refs.popleft()
        return ref

    def __len__(self) -> int:
        return len(self._refs)

    def put_artifact(self, artifact: MediaArtifact) -> ArtifactHandle:
        """Object-store an artifact; return the small handle the graph moves around."""
        return ArtifactHandle(spec=artifact.spec, shape=tuple(artifact.data.shape),
                              dtype=str(artifact.data.dtype).replace("torch.", ""),
                              ref=self.put(artifact), metadata=dict(artifact.metadata))
