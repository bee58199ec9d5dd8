"""Group affinity (deployments/routing.py): the requests of one prompt group land on one rollout
replica, the one rendezvous hashing ranks first for the group, in every round.

The Ray test deploys the tiny graph with two DiTRollout replicas and sends groups split into
several requests each (as a vLLM-Omni-style client sends one request per sample); every result
says which replica ran it (`rollout_replica_pid`)."""
from __future__ import annotations

import collections

import pytest

from contract import PromptBundle, RolloutRequest, SamplingSpec, Task
from deployments.routing import group_key, rendezvous_order, request_group

pytestmark = pytest.mark.timeout(600)

APP = "affinity_t2i"
REQUESTS_PER_GROUP = 3


def test_rendezvous_order_is_stable_and_moves_only_the_leaving_replicas_groups():
    replicas = [f"r{i}" for i in range(5)]
    keys = [bytes([i]) * 16 for i in range(200)]
    first = {k: rendezvous_order(k, replicas)[0] for k in keys}
    assert first == {k: rendezvous_order(k, list(reversed(replicas)))[0] for k in keys}
    assert len(set(first.values())) == 5                   # every replica is someone's first
    after = {k: rendezvous_order(k, replicas[1:])[0] for k in keys}
    moved = {k for k in keys if after[k] != first[k]}
    assert moved == {k for k in keys if first[k] == "r0"}  # only r0's groups move


def test_group_key_of_a_call():
    a = PromptBundle(token_ids=(1, 2, 3))
    b = PromptBundle(token_ids=(1, 2, 4))
    req = RolloutRequest(prompt=a, sampling=SamplingSpec(num_steps=2, seeds=(0,)), task=Task.T2I)
    assert request_group([req, None]) == group_key(a) == request_group([[a, b]])
    assert group_key(a) != group_key(b)
    assert request_group(["v1"]) is None and request_group([]) is None


def test_the_graph_routes_encoder_and_rollout_by_group():
    from deployments.config import load_graph_config
    from deployments.routing import GroupAffinityRouter
    from graph import routing_options
    router = routing_options(load_graph_config({"group_affinity": True}))["request_router_config"]
    assert router.get_request_router_class() is GroupAffinityRouter
    assert routing_options(load_graph_config({})) == {}          # opt-in: Serve's default


def test_a_groups_requests_land_on_its_replica(ray_cluster):
    """The graph's rollout stage alone (two replicas, its router from the graph config), called
    as the ingress calls it: each group's requests run on the replica ranked first for it."""
    from ray import serve

    from adapters.registry import get_family
    from deployments.encoding import encode_prompts, load_encoders
    from graph import build_rollout, delete_graph
    from tests.serve_utils import replica_actors

    config = {"app_name": APP, "rollout": {"adapter": "tiny_t2i"},
              "rollout_stage": {"num_cpus": 0.25, "num_replicas": 2},
              "policy_store": "affinity_test_store", "group_affinity": True}
    from deployments.config import load_graph_config
    handle = serve.run(build_rollout(load_graph_config(config)), name=APP,
                       route_prefix=f"/{APP}")
    try:
        replicas = [name.rsplit("#", 1)[1] for name, _ in replica_actors(APP, "DiTRollout")]
        assert len(replicas) == 2
        family = get_family("tiny_t2i")
        encoders = load_encoders(family)
        # prompts whose groups rank each replica first (two per replica), known before sending
        by_replica: dict[str, list[PromptBundle]] = collections.defaultdict(list)
        for i in range(64):
            bundle = family.conditioner.tokenize([f"a red circle number {i}"])[0]
            first = rendezvous_order(group_key(bundle), replicas)[0]
            if len(by_replica[first]) < 2:
                by_replica[first].append(bundle)
        assert len(by_replica) == 2 and all(len(v) == 2 for v in by_replica.values())
        groups = [b for bundles in by_replica.values() for b in bundles]
        conds = {group_key(b): encode_prompts(family, encoders, [b]) for b in groups}
        expected = {group_key(b): rendezvous_order(group_key(b), replicas)[0] for b in groups}

        pid_of_replica: dict[str, int] = {}
        for round_ in range(2):                       # the same groups land alike again
            requests = [RolloutRequest(prompt=b, task=Task.T2I, sampling=SamplingSpec(
                num_steps=2, seeds=(100 * g + 10 * round_ + j,)))
                for g, b in enumerate(groups) for j in range(REQUESTS_PER_GROUP)]
            responses = [handle.rollout.remote(r, conds[group_key(r.prompt)], ("image_latent",))
                         for r in requests]
            for request, response in zip(requests, responses):
                out = response.result()
                pid = int(out.metrics["rollout_replica_pid"])
                replica = expected[group_key(request.prompt)]
                assert pid_of_replica.setdefault(replica, pid) == pid, (round_, replica)
        assert len(set(pid_of_replica.values())) == 2          # two replicas, two processes
    finally:
        delete_graph(config)
