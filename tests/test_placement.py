"""The whole-graph placement check (deployments/placement.py), as pure functions over declared
node capacities: every stage's starting replicas (placement groups whole, the head's actors)
packed onto the nodes by resource and label; a graph that cannot be placed is a ConfigError
naming the demand, the capacity and the stages that would wait, and autoscaling maxima that
could never be placed are a PlacementWarning with the same figures."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from contract import ConfigError
from deployments.placement import (NodeShape, PlacementWarning, StageDemand, StageReplicas,
                                   check_graph_fits, head_actor, pack)
from deployments.policy_store import HEAD_NODE

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
HEAD = {"node:__internal_head__": 1.0}


def local(cpus: float = 2.0, gpus: float = 0.0, memory_gib: float = 12.0) -> NodeShape:
    """A one-node local cluster (`serve run` on a 2-core machine)."""
    return NodeShape("local", {"CPU": cpus, "GPU": gpus, "memory": memory_gib * GIB, **HEAD})


def replicas(stage: str, deployment: str, start: int = 1, most: int | None = None,
             selector: dict | None = None, **need: float) -> StageReplicas:
    return StageReplicas(StageDemand(stage, deployment, (dict(need),), selector or {}), start,
                         start if most is None else most)


def actors() -> list[StageReplicas]:
    return [StageReplicas(head_actor("policy_store", "PolicyStore", HEAD_NODE), 1, 1),
            StageReplicas(head_actor("app_name", "ObjectHolder", HEAD_NODE), 1, 1)]


def serve_graph(encoder: float, rollout: float, decoder: float) -> list[StageReplicas]:
    """sd3.yaml's shape: encoder, rollout, one decoder, one scorer, the ingress, the actors."""
    return [replicas("encoder", "TextEncoder", CPU=encoder),
            replicas("rollout_stage", "DiTRollout", CPU=rollout),
            replicas("decoder", "Decoder_image_latent", CPU=decoder),
            replicas("scorers[0].stage", "Scorer_image_attributes", CPU=0.25),
            replicas("ingress", "RolloutGraph", CPU=0.25, memory=2 * GIB), *actors()]


def test_fits_on_two_cpus():
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no warning either
        packing = check_graph_fits(serve_graph(0.5, 0.5, 0.25), [local()])
    assert packing.fits
    assert sorted(packing.placed["local"]) == sorted(
        ["TextEncoder", "DiTRollout", "Decoder_image_latent", "Scorer_image_attributes",
         "RolloutGraph", "PolicyStore", "ObjectHolder"])


def test_does_not_fit_by_cpu_names_demand_capacity_and_the_waiting_stages():
    # the old configs/sd3.yaml: 1 + 1 + 0.5 + 0.25 + 0.25 = 3 CPUs on a 2-CPU machine
    with pytest.raises(ConfigError) as e:
        check_graph_fits(serve_graph(1.0, 1.0, 0.5), [local()])
    err = e.value
    assert err.expected["CPU"] == 3.0 and err.actual["CPU"] == 2.0
    assert err.expected["memory"] == "2.00 GiB" and err.actual["memory"] == "12.00 GiB"
    assert "needs [CPU 3.0, GPU 0.0, memory 2.00 GiB]" in err.message
    assert "1 node(s) have [CPU 2.0, GPU 0.0, memory 12.00 GiB]" in err.message
    # the two 1-CPU stages take both CPUs; the rest wait, each named with its config field
    for waiting in ("Decoder_image_latent (decoder) 1 of 1", "RolloutGraph (ingress) 1 of 1",
                    "Scorer_image_attributes (scorers[0].stage) 1 of 1"):
        assert waiting in err.message
    assert "TextEncoder" not in err.message.split("waiting")[1]
    assert err.field == "decoder.resources"


def test_does_not_fit_by_cpu_when_the_sum_does_but_no_node_has_the_room():
    nodes = [NodeShape("a", {"CPU": 1.0}), NodeShape("b", {"CPU": 1.0, **HEAD})]
    graph = [replicas("rollout_stage", "DiTRollout", start=3, CPU=0.6), *actors()]
    with pytest.raises(ConfigError) as e:           # 1.8 <= 2 CPUs, but 0.6 + 0.6 > 1 per node
        check_graph_fits(graph, nodes)
    assert e.value.expected["CPU"] == 1.8 and e.value.actual["CPU"] == 2.0
    assert "DiTRollout (rollout_stage) 1 of 3 replica(s) of [CPU 0.6]" in e.value.message


def test_does_not_fit_by_memory():
    graph = [replicas("rollout_stage", "DiTRollout", CPU=0.5, memory=8 * GIB),
             replicas("encoder", "TextEncoder", CPU=0.5, memory=6 * GIB), *actors()]
    with pytest.raises(ConfigError) as e:
        check_graph_fits(graph, [local(memory_gib=12.0)])
    assert e.value.expected["memory"] == "14.00 GiB"
    assert "TextEncoder (encoder) 1 of 1 replica(s) of [CPU 0.5, memory 6.00 GiB]" in \
        e.value.message


def test_does_not_fit_by_gpu():
    nodes = [NodeShape("gpu-0", {"CPU": 16.0, "GPU": 1.0, **HEAD}),
             NodeShape("gpu-1", {"CPU": 16.0, "GPU": 1.0})]
    graph = [replicas("rollout_stage", "DiTRollout", start=2, CPU=1.0, GPU=0.75),
             replicas("decoder", "Decoder_image_latent", CPU=1.0, GPU=0.5), *actors()]
    with pytest.raises(ConfigError) as e:           # 2.0 GPUs asked of 2, in pieces no node holds
        check_graph_fits(graph, nodes)
    assert e.value.expected["GPU"] == 2.0 and e.value.actual["GPU"] == 2.0
    assert e.value.field == "decoder.resources"
    assert "Decoder_image_latent (decoder) 1 of 1 replica(s) of [CPU 1.0, GPU 0.5]" in \
        e.value.message
    # a GPU graph on the CPU machine: refused, the GPUs it needs and the 0 it has named
    with pytest.raises(ConfigError) as e:
        check_graph_fits(graph, [local(cpus=64.0)])
    assert e.value.expected["GPU"] == 2.0 and e.value.actual["GPU"] == 0.0


def test_does_not_fit_by_label():
    nodes = [NodeShape("head", {"CPU": 8.0, **HEAD}, {"omni.role": "media"}),
             NodeShape("rollout-0", {"CPU": 2.0}, {"omni.role": "rollout"})]
    rollout = replicas("rollout_stage", "DiTRollout", start=3, CPU=1.0,
                       selector={"omni.role": "rollout"})
    with pytest.raises(ConfigError) as e:           # 3 CPUs of 10 overall, 2 on its nodes
        check_graph_fits([rollout, *actors()], nodes)
    assert e.value.field == "rollout_stage.resources"
    assert ("DiTRollout (rollout_stage) 1 of 3 replica(s) of [CPU 1.0] on the 1 node(s) "
            "matching {'omni.role': 'rollout'}, which have [CPU 2.0") in e.value.message
    # without the selector the media node takes the third
    unlabelled = replicas("rollout_stage", "DiTRollout", start=3, CPU=1.0)
    assert check_graph_fits([unlabelled, *actors()], nodes).fits


def test_the_head_actors_need_the_head_node():
    worker = NodeShape("worker", {"CPU": 8.0})      # no node carries the head's resource
    with pytest.raises(ConfigError) as e:
        check_graph_fits([replicas("rollout_stage", "DiTRollout", CPU=1.0), *actors()], [worker])
    assert "PolicyStore (policy_store) 1 of 1" in e.value.message
    assert "ObjectHolder (app_name) 1 of 1" in e.value.message


def test_placement_groups_are_placed_whole():
    # ETP 2: bundle 0 (the replica) + one bundle per shard, STRICT_PACK on one node
    etp = StageDemand("encoder", "TextEncoder", ({"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}))
    nodes = [NodeShape("a", {"CPU": 2.0, **HEAD}), NodeShape("b", {"CPU": 2.0})]
    fits = [StageReplicas(etp, 2, 2), replicas("rollout_stage", "DiTRollout", CPU=0.5),
            *actors()]
    packing = check_graph_fits(fits, nodes)
    assert packing.placed["a"].count("TextEncoder") == 1
    assert packing.placed["b"].count("TextEncoder") == 1
    # 3.75 of 4 CPUs, but each node keeps 0.5 beside its 1.5-CPU group: 0.75 fits nowhere
    too_big = [StageReplicas(etp, 2, 2), replicas("rollout_stage", "DiTRollout", CPU=0.75),
               *actors()]
    with pytest.raises(ConfigError) as e:
        check_graph_fits(too_big, nodes)
    assert e.value.expected["CPU"] == 3.75 and e.value.actual["CPU"] == 4.0
    assert "DiTRollout (rollout_stage) 1 of 1" in e.value.message
    # the group's own size is counted whole: three groups of 1.5 CPUs wait one
    with pytest.raises(ConfigError) as e:
        check_graph_fits([StageReplicas(etp, 3, 3), *actors()], nodes)
    assert "TextEncoder (encoder) 1 of 3 replica(s) of [CPU 1.5]" in e.value.message


def test_autoscaling_maxima_that_never_fit_warn_with_the_figures():
    graph = [replicas("rollout_stage", "DiTRollout", start=1, most=4, CPU=0.5),
             replicas("encoder", "TextEncoder", CPU=0.5), *actors()]
    with pytest.warns(PlacementWarning) as record:
        assert check_graph_fits(graph, [local()]).fits          # deploys: 1 CPU of 2
    [warning] = record
    text = str(warning.message)
    assert "at its autoscaling maxima" in text
    assert "needs [CPU 2.5" in text and "have [CPU 2.0" in text
    assert "DiTRollout (rollout_stage) 1 of 4 replica(s) of [CPU 0.5]" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # maxima that fit: silent
        check_graph_fits([replicas("rollout_stage", "DiTRollout", 1, 2, CPU=0.5), *actors()],
                         [local()])


def test_the_search_finds_what_first_fit_misses():
    # first fit, largest first, puts 5 + 4 on one node and strands a 2; 5+3+2 / 4+4+2 fits
    nodes = [NodeShape("a", {"CPU": 10.0}), NodeShape("b", {"CPU": 10.0})]
    stages = [(StageDemand(f"s{i}", f"S{i}", ({"CPU": float(c)},)), 1)
              for i, c in enumerate((5, 4, 4, 3, 2, 2))]
    packing = pack(stages, nodes)
    assert packing.fits
    cpus = {s.deployment: s.total["CPU"] for s, _ in stages}
    assert sorted(sum(cpus[d] for d in placed) for placed in packing.placed.values()) == [10, 10]
    assert not pack(stages + [(StageDemand("s6", "S6", ({"CPU": 0.5},)), 1)], nodes).fits


def test_a_shipped_config_counts_every_deployment_and_actor():
    """tiny_t2i.yaml as build_app counts it: each deployment at its starting replicas (the
    rollout autoscales 1..2), the ingress, the two head actors; on one 2-CPU node it deploys and
    warns that its second rollout replica never could."""
    from deployments.config import load_graph_config
    from deployments.topology import graph_replicas
    counted = {r.demand.deployment: r for r in graph_replicas(
        load_graph_config(ROOT / "configs" / "tiny_t2i.yaml"))}
    assert set(counted) == {"TextEncoder", "DiTRollout", "Decoder_image_latent",
                            "Scorer_image_attributes", "RolloutGraph", "PolicyStore",
                            "ObjectHolder"}
    assert (counted["DiTRollout"].start, counted["DiTRollout"].most) == (1, 2)
    assert counted["RolloutGraph"].demand.total["memory"] == 1024 * 2**20
    assert counted["PolicyStore"].demand.total == HEAD_NODE
    with pytest.warns(PlacementWarning, match="DiTRollout"):
        check_graph_fits(list(counted.values()), [local()])
