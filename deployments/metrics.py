"""Per-stage Serve metrics (exported by Ray's metrics agent with a `ray_` prefix).

Every stage records: requests, errors by type, latency histogram, batch size, queue depth and
samples/s. Serve adds deployment / replica / application tags itself.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from ray.serve import metrics

_LATENCY_MS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]
_BATCH = [1, 2, 4, 8, 16, 32, 64, 128]


class StageMetrics:
    def __init__(self, stage: str):
        tags = {"stage": stage}
        self.requests = metrics.Counter("omni_stage_requests", description="Calls per stage.",
                                        tag_keys=("stage",))
        self.errors = metrics.Counter("omni_stage_errors", description="Failed calls by type.",
                                      tag_keys=("stage", "error_type"))
        self.latency = metrics.Histogram("omni_stage_latency_ms", description="Call latency.",
                                         boundaries=_LATENCY_MS, tag_keys=("stage",))
        self.batch_size = metrics.Histogram("omni_stage_batch_size", description="Rows per call.",
                                            boundaries=_BATCH, tag_keys=("stage",))
        self.queue_depth = metrics.Gauge("omni_stage_queue_depth",
                                         description="Requests waiting or running.",
                                         tag_keys=("stage",))
        self.samples = metrics.Counter("omni_stage_samples", description="Samples processed.",
                                       tag_keys=("stage",))
        self.samples_per_s = metrics.Gauge("omni_stage_samples_per_s",
                                           description="Samples/s of the last call.",
                                           tag_keys=("stage",))
        self._tags = tags   # passed per call: Serve metrics own their default tags
        self._in_flight = 0

    @contextmanager
    def track(self, samples: int) -> Iterator[None]:
        """Time one call of `samples` rows; count its error type if it raises."""
        tags = self._tags
        self.requests.inc(tags=tags)
        self.batch_size.observe(samples, tags=tags)
        self._in_flight += 1
        self.queue_depth.set(self._in_flight, tags=tags)
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.errors.inc(tags={**tags, "error_type": type(exc).__name__})
            raise
        else:
            elapsed = time.perf_counter() - start
            self.samples.inc(samples, tags=tags)
            self.samples_per_s.set(samples / max(elapsed, 1e-9), tags=tags)
        finally:
            self.latency.observe((time.perf_counter() - start) * 1000.0, tags=tags)
            self._in_flight -= 1
            self.queue_depth.set(self._in_flight, tags=tags)


class CacheMetrics:
    """A stage's cache: hits, misses (Serve counters) and the bytes it holds (a gauge)."""

    def __init__(self, stage: str):
        self.hits = metrics.Counter(f"omni_{stage}_cache_hits", description="Cache hits.",
                                    tag_keys=("stage",))
        self.misses = metrics.Counter(f"omni_{stage}_cache_misses",
                                      description="Cache misses.", tag_keys=("stage",))
        self.nbytes = metrics.Gauge(f"omni_{stage}_cache_bytes", description="Bytes held.",
                                    tag_keys=("stage",))
        self._tags = {"stage": stage}

    def record(self, hits: int, misses: int, nbytes: int) -> None:
        if hits:
            self.hits.inc(hits, tags=self._tags)
        if misses:
            self.misses.inc(misses, tags=self._tags)
        self.nbytes.set(nbytes, tags=self._tags)
