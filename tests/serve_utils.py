"""Finding a deployment's replica actors (fault-injection tests kill them)."""
from __future__ import annotations


def replica_actors(app: str, deployment: str) -> list[tuple[str, str]]:
    """(name, namespace) of every live replica actor of `deployment` in Serve app `app`."""
    import ray
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
