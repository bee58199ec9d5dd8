"""Where stages run: each stage's placement request checked against the cluster's nodes.

A stage states where it may run in its StageOptions (deployments/config.py):
    resources    custom Ray resources per replica, e.g. {"rollout_gpu_node": 0.01}; a node offers
                 them with `ray start --resources '{"rollout_gpu_node": 1}'`
    node_labels  a Ray label selector, e.g. {"omni.role": "rollout"}; a node carries labels from
                 `ray start --labels omni.role=rollout`. Values: "v", "!v", "in(a,b)", "!in(a,b)"
`StageOptions.deployment_options` turns them into `ray_actor_options` (`resources`,
`label_selector`); for a stage with a placement group (the ETP encoder) `into_bundles` moves them
onto the bundles, so the whole STRICT_PACK group lands on one matching node.

`check_placement(demands, nodes)` is run by graph.build_app against the live cluster (and by the
manifest test against the manifests' node groups): a stage that no node can hold is a ConfigError
naming the stage's config field and the resource or label, at build time -- not a replica that
waits forever for resources that never come.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from contract import ConfigError

BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_SELECTOR = re.compile(rf"^(?P<neg>!)?(?:in\((?P<set>{_LABEL}(?:, ?{_LABEL})*)\)|(?P<one>{_LABEL}))$")
_EPS = 1e-9


def parse_selector_value(value: str) -> tuple[bool, frozenset[str]]:
    """A label selector value -> (negated, allowed values). ConfigError when malformed."""
    m = _SELECTOR.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError("invalid node label selector value (use 'v', '!v', 'in(a,b)' or "
                          "'!in(a,b)')", field="node_labels", actual=value)
    values = m.group("set") or m.group("one")
    return m.group("neg") is not None, frozenset(v.strip() for v in values.split(","))


def labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Ray's label-selector semantics: every key must hold; '!' also holds when the key is absent."""
    for key, value in selector.items():
        negated, allowed = parse_selector_value(value)
        present = labels.get(key) in allowed
        if present == negated:
            return False
    return True


@dataclass(frozen=True)
class NodeShape:
    """One node of a cluster (or one node of a manifest's node group): its total resources."""

    name: str
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StageDemand:
    """One replica of a stage: its resource bundles (more than one = a STRICT_PACK placement
    group, all on one node) and its label selector."""

    stage: str                    # config field, e.g. "rollout_stage", "scorers[0].stage"
    deployment: str               # Serve deployment name, e.g. "DiTRollout"
    bundles: tuple[Mapping[str, float], ...]
    label_selector: Mapping[str, str] = field(default_factory=dict)

    @property
    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for bundle in self.bundles:
            for key, value in bundle.items():
                out[key] = out.get(key, 0.0) + float(value)
        return {k: v for k, v in out.items() if v > 0}


def demand_from_options(stage: str, options: Mapping[str, Any]) -> StageDemand:
    """The StageDemand of one replica from the Serve options graph.py builds for it."""
    actor = options.get("ray_actor_options", {})
    if options.get("placement_group_bundles"):
        bundles = tuple(dict(b) for b in options["placement_group_bundles"])
        selectors = options.get("placement_group_bundle_label_selector") or [{}]
        selector = dict(selectors[0])
    else:
        bundle = {"CPU": actor.get("num_cpus", 1.0), "GPU": actor.get("num_gpus", 0.0),
                  **({"memory": actor["memory"]} if actor.get("memory") else {}),
                  **actor.get("resources", {})}
        bundles = (bundle,)
        selector = dict(actor.get("label_selector", {}))
    return StageDemand(stage, options["name"], bundles, selector)


def into_bundles(options: dict[str, Any]) -> dict[str, Any]:
    """For a stage with a placement group: its custom resources join bundle 0 (the replica's, as
    Serve requires) and its label selector applies to every bundle."""
    bundles = options.get("placement_group_bundles")
    if not bundles:
        return options
    actor = dict(options["ray_actor_options"])
    resources = actor.get("resources", {})
    selector = actor.pop("label_selector", None)
    first = dict(bundles[0])
    for key, value in resources.items():
        first[key] = first.get(key, 0.0) + value
    out = dict(options, ray_actor_options=actor,
               placement_group_bundles=[first] + [dict(b) for b in bundles[1:]])
    if selector:
        out["placement_group_bundle_label_selector"] = [dict(selector)]
    return out


def _fits(demand: Mapping[str, float], node: NodeShape) -> bool:
    return all(node.resources.get(k, 0.0) + _EPS >= v for k, v in demand.items())


def check_placement(demands: Iterable[StageDemand], nodes: Sequence[NodeShape]) -> None:
    """Every stage must fit on at least one node whose labels match: ConfigError otherwise, with
    `field` = "<stage>.node_labels" (no node matches) or "<stage>.resources.<resource>" (the
    first resource no matching node has enough of), `expected` the replica's need and `actual`
    the most any matching node offers."""
    if not nodes:
        raise ConfigError("the cluster has no live nodes to place the graph on", field="nodes")
    for d in demands:
        matching = [n for n in nodes if labels_match(d.label_selector, n.labels)]
        if not matching:
            raise ConfigError(f"no node carries the labels {d.deployment} asks for",
                              field=f"{d.stage}.node_labels", expected=dict(d.label_selector),
                              actual={n.name: dict(n.labels) for n in nodes})
        need = d.total
        if any(_fits(need, n) for n in matching):
            continue
        packed = len(d.bundles) > 1
        for key, value in need.items():           # name the resource that does not fit
            most = max(n.resources.get(key, 0.0) for n in matching)
            if most + _EPS < value:
                what = (f"the {len(d.bundles) - 1}-shard placement group of {d.deployment} "
                        "(STRICT_PACK: all shards on one node)" if packed
                        else f"one {d.deployment} replica")
                raise ConfigError(f"no node has the {key} for {what}",
                                  field=f"{d.stage}.resources.{key}", expected=value, actual=most)
        raise ConfigError(f"no single node has all the resources of one {d.deployment} replica",
                          field=f"{d.stage}.resources", expected=need,
                          actual={n.name: dict(n.resources) for n in matching})


def live_nodes() -> list[NodeShape]:
    """The connected cluster's alive nodes (total resources, labels)."""
    import ray
    return [NodeShape(n["NodeID"][:12], dict(n.get("Resources", {})), dict(n.get("Labels", {})))
            for n in ray.nodes() if n.get("Alive")]


def check_resource_names(resources: Mapping[str, float]) -> Mapping[str, float]:
    """Custom resources only (CPU/GPU/memory have their own fields); positive amounts."""
    for key, value in resources.items():
        if key in BUILTIN_RESOURCES:
            raise ConfigError(f"{key} has its own field; `resources` names custom resources",
                              field=f"resources.{key}", actual=value)
        if not value > 0:
            raise ConfigError("a custom resource amount must be > 0", field=f"resources.{key}",
                              expected="> 0", actual=value)
    return resources


def check_selector(selector: Mapping[str, str]) -> Mapping[str, str]:
    for key, value in selector.items():
        if not re.fullmatch(rf"([a-zA-Z0-9.-]+/)?{_LABEL}", key):
            raise ConfigError("invalid node label key", field=f"node_labels.{key}", actual=key)
        parse_selector_value(value)
    return selector


def pack_first_fit(demands: Sequence[tuple[StageDemand, int]],
                   nodes: Sequence[NodeShape]) -> dict[str, list[str]]:
    """Place `count` replicas of each demand on `nodes` (first fit, largest demands first);
    returns node name -> deployments placed. ConfigError naming the stage that does not fit.
    Used to check a manifest's node groups hold every stage at its maximum replica count."""
    free = {n.name: dict(n.resources) for n in nodes}
    placed: dict[str, list[str]] = {n.name: [] for n in nodes}
    order = sorted(((d, c) for d, c in demands),
                   key=lambda dc: -sum(v for k, v in dc[0].total.items() if k != "memory"))
    for d, count in order:
        for _ in range(count):
            for n in nodes:
                left = free[n.name]
                if labels_match(d.label_selector, n.labels) and all(
                        left.get(k, 0.0) + _EPS >= v for k, v in d.total.items()):
                    for k, v in d.total.items():
                        left[k] = left.get(k, 0.0) - v
                    placed[n.name].append(d.deployment)
                    break
            else:
                raise ConfigError(f"the node groups cannot hold {count} replicas of "
                                  f"{d.deployment} next to the other stages",
                                  field=f"{d.stage}.resources", expected=d.total,
                                  actual={k: {r: round(v, 3) for r, v in left.items()}
                                          for k, left in free.items()})
    return placed
