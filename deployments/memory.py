"""Per-replica memory bound.

Each stage declares `memory_mib` (deployments/config.py::StageOptions). Ray schedules the replica
by it (`ray_actor_options["memory"]`), and the replica holds itself to it: `guard_replica_memory()`
(called first in every stage's constructor) reads the replica's assigned `memory` resource and
starts a `MemoryGuard` thread that ends the process once its anonymous resident memory (heap,
tensors; not shared libraries or object-store pages) passes that bound. A runaway replica is then
the one that goes -- Serve replaces it and its in-flight requests fail as a retryable
ReplicaFailedError -- long before the node's memory monitor would pick a victim, which can be the
Serve controller or the policy store holding the trainer's versions.

The guard samples every `interval_s` (50 ms): a replica can overshoot its bound by what it
allocates in one interval before it is stopped.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("ray.serve")

MEMORY_EXIT_CODE = 137          # what a process killed for memory reports
_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "VmHWM": "peak_rss_bytes"}


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of a process in bytes: rss, rss_anon (heap and private tensors), and
    peak_rss (the high-water mark since start or the last `reset_peak_rss`). Linux /proc."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in _STATUS_FIELDS:
                out[_STATUS_FIELDS[key]] = int(rest.split()[0]) * 1024     # kB -> bytes
    return out


def reset_peak_rss() -> None:
    """Restart this process's peak-RSS high-water mark at its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class MemoryGuard:
    """A daemon thread ending this process when its anonymous RSS passes `limit_bytes`."""

    def __init__(self, limit_bytes: int, stage: str, interval_s: float = 0.05):
        self.limit_bytes = int(limit_bytes)
        self.stage = stage
        self.interval_s = interval_s
        self._thread = threading.Thread(target=self._watch, name=f"memory-guard-{stage}",
                                        daemon=True)

    def start(self) -> "MemoryGuard":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _watch(self) -> None:
        while True:
            used = process_memory()["rss_anon_bytes"]
            if used > self.limit_bytes:
                self._exceeded(used)
            time.sleep(self.interval_s)

    def _exceeded(self, used: int) -> None:
        message = (f"{self.stage} replica (pid {os.getpid()}) holds {used / 2**20:.0f} MiB of "
                   f"anonymous memory, over its declared bound of "
                   f"{self.limit_bytes / 2**20:.0f} MiB (memory_mib): ending the replica so "
                   "Serve replaces it")
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(MEMORY_EXIT_CODE)


def guard_replica_memory(stage: str) -> MemoryGuard | None:
    """Start the guard at the `memory` resource Ray assigned to this replica; None when the
    stage declares no memory (or outside Ray)."""
    import ray
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None                          # not a replica: a driver building a stage in-process
    limit = ray.get_runtime_context().get_assigned_resources().get("memory")
    if not limit:
        return None
    return MemoryGuard(int(limit), stage).start()
