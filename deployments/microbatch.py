"""Micro-batching of concurrent stage calls with failure isolation, shared by the encoder, decoder
and scorer stages (each wraps it in its own `@serve.batch` method).

`run_isolated(items, key, run)`: items whose keys are equal run together in one `run` call,
which returns one result per item; when a joint run raises, each item of that group runs alone,
so a failing item fails only itself (its exception in its slot, raised by its own caller) and
the others get what they would get alone. No Serve or Ray here: the stages' in-process tests
call it directly.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def groups_by_key(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[int]]:
    """Indices of `items` grouped by key, groups in first-arrival order."""
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


async def run_isolated(items: Sequence[T], key: Callable[[T], Hashable],
                       run: Callable[[list[T]], Awaitable[Sequence[R]]]
                       ) -> list[R | Exception]:
    """One `run` per key group (one result per item, in order); a group whose joint run raises
    is run item by item, each item's exception returned in its slot."""
    results: list[R | Exception | None] = [None] * len(items)
    for idx in groups_by_key(items, key):
        group = [items[i] for i in idx]
        try:
            parts: Sequence[R | Exception] = await run(group)
            if len(parts) != len(group):
                raise RuntimeError(f"a micro-batch run returned {len(parts)} results for "
                                   f"{len(group)} calls")
        except Exception as exc:  # noqa: BLE001 -- returned to the failing caller
            if len(group) == 1:
                parts = [exc]
            else:
                parts = []
                for item in group:
                    try:
                        [one] = await run([item])
                        parts.append(one)
                    except Exception as alone:  # noqa: BLE001
                        parts.append(alone)
        for i, part in zip(idx, parts):
            results[i] = part
    return results   # type: ignore[return-value]


def in_serve_replica() -> bool:
    """Whether this process runs a Ray Serve replica (`@serve.batch` works only there; a stage
    class used in-process runs each call as a batch of one)."""
    import ray
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    from ray import serve
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 -- an actor, not a Serve replica
        return False
    return True
