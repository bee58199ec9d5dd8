"""The graph on a two-node Ray cluster on loopback (`ray start --head` + `ray start --address`,
testing/loopback.py), its own cluster for this module: marked `cluster`, run by its own pytest
process in `make test` (a driver joins one Ray cluster per process; the default suite's
session cluster stays untouched).

    head     4 CPUs, {stage_node: 8},   omni.role=stages   encoder (ETP 2), decoder, scorer, ingress
    rollout  2 CPUs, {rollout_node: 8}, omni.role=rollout  DiTRollout (autoscaled 1..2)

Checks, in order: every stage runs where its declared resources / labels put it (the ETP shards
packed with their replica on one node, the policy store on the head); placements no node can
hold are ConfigErrors naming the stage and the resource at build time; chaos on every stage under
HTTP + handle load with a trainer attached from a third process (the chaos table, testing/chaos.py);
the rollout node's raylet killed mid-load -- typed retryable failures, none lost, none answered
twice -- and the graph serving again when the node returns.
"""
from __future__ import annotations

import json
import time

import pytest

from testing.chaos import (ROLLOUT_LABEL, SCENARIOS, STAGES_LABEL, AttachedTrainer, ChaosSetup,
                         check_row, cluster_graph_config, run_node_loss, run_scenario,
                         two_node_cluster, wait_for)
from contract import ConfigError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

APP = "cluster"
STORE = "cluster_store"


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster("omni-cluster-tests") as c:
        yield c


@pytest.fixture(scope="module")
def graph(cluster):
    from ray import serve

    from graph import build_app
    handle = serve.run(build_app(cluster_graph_config(APP, STORE)), name=APP,
                       route_prefix=f"/{APP}")
    yield handle
    serve.delete(APP)


@pytest.fixture(scope="module")
def family():
    from adapters.registry import get_family
    return get_family("tiny_t2i")


def _actor_nodes() -> list[tuple[str, str, str]]:
    """(class name, actor name, node id) of every alive actor (GCS actor table)."""
    from ray._private.state import actors
    return [(a["ActorClassName"], a.get("Name") or "", a["Address"]["NodeID"])
            for a in actors().values() if a["State"] == "ALIVE"]


def test_stages_run_where_the_config_places_them(cluster, graph, family):
    import ray
    head, rollout = (cluster.lb.node_id(cluster.lb.nodes["head"]),
                     cluster.lb.node_id(cluster.rollout))
    where: dict[str, set[str]] = {}
    for cls, name, node in _actor_nodes():
        if name.startswith(f"SERVE_REPLICA::{APP}#"):
            where.setdefault(name.split("#")[1], set()).add(node)
        elif cls.endswith("ShardWorker") or cls.endswith("PolicyStore"):
            where.setdefault(cls.rsplit(".", 1)[-1], set()).add(node)
    assert where.pop("DiTRollout") == {rollout}, "the rollout stage left its node"
    assert where.pop("PolicyStore") == {head}
    assert set(where) == {"TextEncoder", "ShardWorker", "Decoder_image_latent",
                          "Scorer_image_attributes", "RolloutGraph"}
    assert all(nodes == {head} for nodes in where.values()), where
    # the ETP group: one STRICT_PACK placement group, replica + 2 shard bundles, one node
    groups = [g for g in ray.util.placement_group_table().values()
              if g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK"]
    assert len(groups) == 1 and len(groups[0]["bundles"]) == 3
    assert set(groups[0]["bundles_to_node_id"].values()) == {head}
    # a request crosses both nodes: latents made on `rollout`, decoded and scored on `head`
    from contract import RolloutRequest, SamplingSpec, Task
    from deployments.client import RolloutClient
    bundle = family.conditioner.tokenize(["a red circle at the top left on a black background"])
    [out] = RolloutClient(graph).rollout([RolloutRequest(
        prompt=bundle[0], task=Task.T2I, request_id="cross-node",
        sampling=SamplingSpec(num_steps=4, seeds=(0, 1)))])
    assert out.request_id == "cross-node" and len(out.rewards.total) == 2
    assert out.artifacts["image"].data.shape[0] == 2


def test_placements_no_node_can_hold_fail_at_build_time(cluster):
    from graph import build_app
    config = cluster_graph_config(APP, STORE)
    cases = [
        ({"rollout_stage": dict(config["rollout_stage"], resources={"gpu_node": 0.01})},
         "rollout_stage.resources.gpu_node", "gpu_node"),
        ({"decoder": {"node_labels": {"omni.role": "learner"}}}, "decoder.node_labels", None),
        # 6 shards x 1 CPU + the replica, STRICT_PACK: more CPUs than any one node has
        ({"encoder": dict(config["encoder"], etp=6, num_cpus_per_shard=1.0)},
         "encoder.resources.CPU", "CPU"),
    ]
    for override, field, resource in cases:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            build_app(dict(config, **override))
        assert e.value.field == field, e.value
        assert time.monotonic() - t0 < 30          # at build time, not a hang
        if resource is not None:
            assert resource in e.value.message or resource in e.value.field


def test_chaos_on_every_stage_with_a_trainer_attached(cluster, graph, family, tmp_path):
    from testing.loopback import LOOPBACK_ENV
    import os
    trainer = AttachedTrainer(tmp_path / "trainer", cluster_graph_config(APP, STORE),
                              dict(os.environ, **LOOPBACK_ENV), cluster.lb.address)
    try:
        started = wait_for(lambda: trainer.steps() >= 1 or not trainer.alive(), 600, 2.0)
        assert started is not None and trainer.alive(), trainer.tail()
        setup = ChaosSetup(APP, STORE, graph, family,
                           f"http://127.0.0.1:{cluster.http_port}/{APP}/rollout", trainer)
        rows = []
        for scenario in SCENARIOS:
            row = run_scenario(setup, scenario)
            rows.append(row)
            print(json.dumps(row))
            assert trainer.alive(), trainer.tail()
        steps, retries = trainer.steps(), trainer.retries()
    finally:
        trainer.stop()
    (tmp_path / "chaos.json").write_text(json.dumps(rows, indent=2))
    problems = {row["scenario"]: check_row(row) for row in rows}
    assert not any(problems.values()), (problems, trainer.tail())
    assert steps >= len(SCENARIOS)
    print(f"trainer: {steps} steps, {retries} rollout retries across the faults")


def test_rollout_node_lost_mid_load_then_back(cluster, graph, family):
    setup = ChaosSetup(APP, STORE, graph, family,
                       f"http://127.0.0.1:{cluster.http_port}/{APP}/rollout")
    row = run_node_loss(setup, cluster.lb, cluster.rollout)
    print(json.dumps(row))
    assert not check_row(row), row
