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

`check_graph_fits(stages, nodes)` then packs the whole graph: every stage's starting replicas
(`StageReplicas`: placement groups as one STRICT_PACK item, ETP shards included; the ingress; the
policy store and object holder actors on the head) onto the nodes' totals by resource and label.
When they cannot all be placed it is a ConfigError naming the demand per resource, the cluster's
capacity and the stages that would wait; replicas up to the autoscaling maxima that could never
be placed are a `PlacementWarning` with the same figures. Capacity is the nodes' totals (what
other applications hold is not subtracted). Packing is first fit, largest first, then (up to
EXACT_SEARCH_ITEMS replicas) an exhaustive search within EXACT_SEARCH_STEPS tries, so a small
graph is not refused for a heuristic's miss.
"""
from __future__ import annotations

import re
import warnings
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


@dataclass(frozen=True)
class StageReplicas:
    """A stage's replica (its StageDemand) and how many replicas it runs: `start` when deployed
    (num_replicas, or autoscaling's initial / min replicas), `most` at its autoscaling maximum."""

    demand: StageDemand
    start: int
    most: int


def replica_counts(options: Mapping[str, Any]) -> tuple[int, int]:
    """(replicas Serve starts, replicas it may scale to) from a deployment's Serve options."""
    auto = options.get("autoscaling_config")
    if auto:
        start = auto.get("initial_replicas")
        start = auto.get("min_replicas", 1) if start is None else start
        return int(start), int(auto.get("max_replicas", 1))
    count = int(options.get("num_replicas", 1))
    return count, count


def head_actor(stage: str, name: str, resources: Mapping[str, float]) -> StageDemand:
    """A detached actor of the graph (policy store, object holder): no CPU, the head's resource."""
    return StageDemand(stage, name, ({"CPU": 0.0, **resources},))


class PlacementWarning(UserWarning):
    """The graph fits at its starting replicas but not at its autoscaling maxima."""


@dataclass(frozen=True)
class Packing:
    """Replicas placed on nodes (node name -> deployments) and those no node had room for."""

    placed: Mapping[str, list[str]]
    waiting: tuple[tuple[StageDemand, int, int], ...]   # (stage, replicas waiting, asked for)

    @property
    def fits(self) -> bool:
        return not self.waiting


EXACT_SEARCH_ITEMS = 40          # replicas up to which a first-fit miss is searched exhaustively
EXACT_SEARCH_STEPS = 200_000     # the search's bound (tries of one replica on one node)


def pack(stages: Sequence[tuple[StageDemand, int]], nodes: Sequence[NodeShape],
         first: Sequence[int] | None = None) -> Packing:
    """Place `count` replicas of each demand on the nodes' total resources, each replica (a
    placement group whole) on one node whose labels match: first fit, largest dominant share
    first (the `first[i]` replicas of stage i before any other: the running ones before those
    autoscaling would add); when that leaves replicas waiting and there are at most
    EXACT_SEARCH_ITEMS, an exhaustive search (bounded by EXACT_SEARCH_STEPS) looks for a
    placement first fit missed."""
    capacity = _sum(n.resources for n in nodes)
    needs = [d.total for d, _ in stages]
    matching = [[i for i, n in enumerate(nodes) if labels_match(d.label_selector, n.labels)]
                for d, _ in stages]

    def size(item: tuple[int, int]) -> tuple:
        s, rank = item
        share = max((v / capacity[k] if capacity.get(k, 0.0) > 0 else float("inf")
                     for k, v in needs[s].items()), default=0.0)
        return (first is not None and rank >= first[s], -share, len(matching[s]),
                stages[s][0].deployment, s)

    items = [s for s, _ in sorted(((s, rank) for s, (_, count) in enumerate(stages)
                                   for rank in range(count)), key=size)]
    free = [dict(n.resources) for n in nodes]
    where: list[int | None] = []
    for s in items:
        i = next((i for i in matching[s] if _room(free[i], needs[s])), None)
        if i is not None:
            _take(free[i], needs[s])
        where.append(i)
    if None in where and len(items) <= EXACT_SEARCH_ITEMS:
        where = _search(items, needs, matching, nodes) or where
    placed: dict[str, list[str]] = {n.name: [] for n in nodes}
    waiting = [0] * len(stages)
    for s, i in zip(items, where):
        if i is None:
            waiting[s] += 1
        else:
            placed[nodes[i].name].append(stages[s][0].deployment)
    return Packing(placed, tuple((d, waiting[s], count) for s, (d, count) in enumerate(stages)
                                 if waiting[s]))


def _room(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _take(free: dict[str, float], need: Mapping[str, float], sign: float = 1.0) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - sign * v


def _search(items: Sequence[int], needs: Sequence[Mapping[str, float]],
            matching: Sequence[list[int]], nodes: Sequence[NodeShape]) -> list[int | None] | None:
    """Every replica placed, by depth-first search (replicas of one stage on non-decreasing
    nodes, nodes left in the same state tried once per level); None when there is no such
    placement or the search ran out of steps."""
    free = [dict(n.resources) for n in nodes]
    where: list[int | None] = [None] * len(items)
    steps = 0

    def place(k: int) -> bool:
        nonlocal steps
        if k == len(items):
            return True
        s, need = items[k], needs[items[k]]
        lowest = where[k - 1] if k and items[k - 1] == s else 0
        seen: set = set()
        for i in matching[s]:
            if i < lowest or not _room(free[i], need):
                continue
            state = (tuple(sorted(free[i].items())), tuple(sorted(nodes[i].labels.items())))
            if state in seen:
                continue
            seen.add(state)
            steps += 1
            if steps > EXACT_SEARCH_STEPS:
                return False
            _take(free[i], need)
            where[k] = i
            if place(k + 1):
                return True
            _take(free[i], need, -1.0)
            where[k] = None
        return False

    return where if place(0) else None


def _sum(resources: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def _figures(resources: Mapping[str, float], keys: Iterable[str]) -> dict[str, float | str]:
    """Resources as a user reads them: memory in GiB, amounts rounded."""
    out: dict[str, float | str] = {}
    for k in keys:
        v = resources.get(k, 0.0)
        out[k] = f"{v / 2**30:.2f} GiB" if k in ("memory", "object_store_memory") else round(v, 3)
    return out


def _text(figures: Mapping[str, float | str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in figures.items())


def _reported(keys: Iterable[str]) -> list[str]:
    """The resources a message names: CPU, GPU, memory and any custom one a stage asks for."""
    extra = sorted({k for k in keys if not k.startswith("node:") and k not in BUILTIN_RESOURCES})
    return ["CPU", "GPU", "memory", *extra]


def _describe(stages: Sequence[tuple[StageDemand, int]], nodes: Sequence[NodeShape],
              packing: Packing, when: str) -> tuple[str, dict, dict]:
    demand = _sum({k: v * count for k, v in d.total.items()} for d, count in stages)
    capacity = _sum(n.resources for n in nodes)
    keys = _reported(demand)
    need, have = _figures(demand, keys), _figures(capacity, keys)
    waits = []
    for d, count, asked in packing.waiting:
        one = _figures(d.total, [k for k in _reported(d.total) if d.total.get(k, 0.0) > 0])
        line = (f"{d.deployment} ({d.stage}) {count} of {asked} replica(s) of "
                f"[{_text(one) or 'nothing'}]")
        if d.label_selector:
            ok = [n for n in nodes if labels_match(d.label_selector, n.labels)]
            line += (f" on the {len(ok)} node(s) matching {dict(d.label_selector)}, which have "
                     f"[{_text(_figures(_sum(n.resources for n in ok), keys))}]")
        waits.append(line)
    message = (f"the graph does not fit the cluster {when}: it needs [{_text(need)}], the "
               f"cluster's {len(nodes)} node(s) have [{_text(have)}]; waiting for resources: "
               + "; ".join(waits))
    return message, need, have


def check_graph_fits(stages: Sequence[StageReplicas], nodes: Sequence[NodeShape]) -> Packing:
    """The whole graph at its starting replica counts packed onto the nodes: a ConfigError when
    some replicas would wait (field = the first waiting stage's resources, expected = the
    demand per resource, actual = the cluster's capacity; the message names every waiting
    stage). At the autoscaling maxima, a PlacementWarning with the same figures. Returns the
    packing of the starting replicas."""
    if not nodes:
        raise ConfigError("the cluster has no live nodes to place the graph on", field="nodes")
    start = [(r.demand, r.start) for r in stages]
    packing = pack(start, nodes)
    if not packing.fits:
        message, need, have = _describe(start, nodes, packing, "at its starting replica counts")
        first = packing.waiting[0][0]
        raise ConfigError(message + ". Lower the stages' num_cpus / num_gpus / memory_mib or "
                          "replica counts, or add nodes", field=f"{first.stage}.resources",
                          expected=need, actual=have)
    most = [(r.demand, r.most) for r in stages]
    if any(r.most > r.start for r in stages):
        at_max = pack(most, nodes, first=[r.start for r in stages])
        if not at_max.fits:
            message, _, _ = _describe(most, nodes, at_max, "at its autoscaling maxima")
            warnings.warn(PlacementWarning(message + ": those replicas would never start"),
                          stacklevel=2)
    return packing


def pack_first_fit(demands: Sequence[tuple[StageDemand, int]],
                   nodes: Sequence[NodeShape]) -> dict[str, list[str]]:
    """Place `count` replicas of each demand on `nodes` (`pack`); returns node name ->
    deployments placed. ConfigError naming the first stage that does not fit. Used to check a
    manifest's node groups hold every stage at its maximum replica count."""
    packing = pack(demands, nodes)
    if not packing.fits:
        d, waiting, count = packing.waiting[0]
        raise ConfigError(f"the node groups cannot hold {count} replicas of {d.deployment} "
                          f"next to the other stages ({waiting} would wait)",
                          field=f"{d.stage}.resources", expected=d.total,
                          actual={n.name: dict(n.resources) for n in nodes})
    return dict(packing.placed)
