"""Finding a deployment's replica actors (fault-injection tests kill them) and waiting until
requests are inside one."""
from __future__ import annotations


def replica_actors(app: str, deployment: str) -> list[tuple[str, str]]:
    """(name, namespace) of every live replica actor of `deployment` in Serve app `app`."""
    import ray
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]


def wait_until_ongoing(replica: tuple[str, str], at_least: int, timeout_s: float = 120.0) -> int:
    """Block until the replica actor (name, namespace) holds `at_least` ongoing requests (Serve's
    own count, answered off the replica's event loop), so a kill surely lands on them."""
    import time

    import ray
    actor = ray.get_actor(*replica)
    deadline = time.monotonic() + timeout_s
    while (ongoing := ray.get(actor.get_num_ongoing_requests.remote())) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replica[0]} holds {ongoing} requests, not {at_least}, after "
                               f"{timeout_s} s")
        time.sleep(0.05)
    return ongoing


class MemoryHog:
    """A Serve deployment body under the stages' memory guard that allocates on request (the
    memory-isolation test forces it past its declared bound)."""

    def __init__(self):
        from deployments.memory import guard_replica_memory
        self.guard = guard_replica_memory("MemoryHog")
        self.held: list = []

    async def info(self) -> tuple[int, int | None, int]:
        """(pid, the guard's bound, anonymous RSS now), bytes."""
        import os

        from deployments.memory import process_memory
        return (os.getpid(), None if self.guard is None else self.guard.limit_bytes,
                process_memory()["rss_anon_bytes"])

    async def grow(self, mib: int, step_mib: int = 16) -> int:
        """Hold `mib` more MiB of touched pages, `step_mib` at a time (the guard stops it)."""
        import asyncio

        import numpy as np
        for _ in range(mib // step_mib):
            self.held.append(np.ones(step_mib * 2**20, dtype=np.uint8))
            await asyncio.sleep(0.02)
        return len(self.held) * step_mib


class IngressDyingInRelease:
    """A Serve deployment body with the ingress's `rollout` / `release` methods whose first
    `release` (marked by creating `marker`) kills its own replica while the call is in flight;
    Serve's replacement answers the next one (the client's resend test uses it)."""

    def __init__(self, marker: str):
        self.marker = marker

    async def rollout(self, requests) -> list:
        return []

    async def release(self, request_ids) -> int:
        import os
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return len(request_ids)
