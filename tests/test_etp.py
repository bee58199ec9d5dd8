"""TextEncoder with encoder tensor parallelism (ETP) on a real local Ray cluster.

The encoder is the pretrained all-MiniLM-L6-v2 (BertModel, 12 heads) the tiny_t2i adapter uses.
Checks: ETP output == unsharded output at etp 1, 2, 4; each shard holds ~1/etp of the split
layers; the shard workers die with the Serve app; a bad etp is a ConfigError naming `etp`.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from contract import (ConfigError, InvalidRequestError, LimitExceededError, PromptBundle,
                      ReplicaFailedError)
from deployments.encoder import TextEncoderServer
from deployments.encoding import load_encoders
from deployments.etp import check_etp, param_bytes, valid_etp_values

pytestmark = pytest.mark.timeout(300)

SHARD_MEMORY = 2 * 2**30       # each shard worker's bound: its bundle + its own guard
TEXTS = ["a red circle on the left", "two small blue squares",
         "a large green triangle in the top right corner next to a yellow star", "cat"]


@pytest.fixture(scope="module")
def reference(tiny_t2i_weights):
    """Prompts and the unsharded encoder's Condition for them (in this process)."""
    from adapters.registry import get_family
    family = get_family("tiny_t2i", tiny_t2i_weights)
    encoders = load_encoders(family)
    prompts = family.conditioner.tokenize(TEXTS)
    return prompts, family.conditioner.encode(encoders, prompts), param_bytes(encoders, family)


def test_etp_values_and_bad_etp(tiny_t2i_weights):
    assert valid_etp_values(12) == (1, 2, 3, 4, 6, 12)
    assert check_etp(6, 12) == 6
    for bad in (5, 0, 24, 2.0, True):
        with pytest.raises(ConfigError) as e:
            check_etp(bad, 12)
        assert e.value.field == "etp" and e.value.actual == bad
    with pytest.raises(ConfigError) as e:          # the replica checks before any worker starts
        TextEncoderServer("tiny_t2i", tiny_t2i_weights, etp=5)
    assert e.value.field == "etp" and e.value.actual == 5
    assert e.value.expected == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ConfigError) as e:
        TextEncoderServer.deployment_options(0, 0.25)
    assert e.value.field == "etp"
    with pytest.raises(ConfigError) as e:          # etp > 1 without the derived placement group
        TextEncoderServer("tiny_t2i", tiny_t2i_weights, etp=2)
    assert e.value.field == "etp"


def test_deployment_options_derive_placement():
    assert TextEncoderServer.deployment_options(1, 0.25, 0.5) == {}
    opts = TextEncoderServer.deployment_options(4, 0.5, 0.25)
    assert opts == {"placement_group_bundles": [{"CPU": 0.25}] + [{"CPU": 0.5}] * 4,
                    "placement_group_strategy": "STRICT_PACK"}
    gpu = TextEncoderServer.deployment_options(2, 1.0, 0.25, num_gpus_per_shard=1.0)
    assert gpu["placement_group_bundles"][1:] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    # memory bounds from the graph config: the replica's bundle and each shard's
    from deployments.config import load_graph_config
    from deployments.topology import encoder_options
    config = load_graph_config({"rollout": {"adapter": "tiny_t2i"}, "encoder": {
        "etp": 2, "memory_mib": 1024, "memory_mib_per_shard": 512}})
    bundles = encoder_options(config)["placement_group_bundles"]
    assert [b["memory"] for b in bundles] == [1024 * 2**20, 512 * 2**20, 512 * 2**20]
    with pytest.raises(ConfigError) as e:          # nccl ranks need a whole GPU each
        TextEncoderServer.deployment_options(2, 1.0, device="cuda")
    assert e.value.field == "num_gpus_per_shard"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _check_condition(cond, ref, prompts) -> None:
    assert cond["hidden"].shape == ref["hidden"].shape == (4, 32, 384)
    assert torch.equal(cond["mask"], ref["mask"])
    assert (cond["hidden"] - ref["hidden"]).abs().max().item() <= 1e-5
    assert (cond["pooled"] - ref["pooled"]).abs().max().item() <= 1e-5
    assert cond.token_ids == tuple({"minilm": p.token_ids} for p in prompts)
    # pads differ per row: the mask really came from the ids as given
    assert cond["mask"].sum(1).tolist() == [len(p.token_ids) for p in prompts]


def test_etp1_runs_in_process(tiny_t2i_weights, reference):
    """etp 1: no workers, no placement group; the replica body encodes in-process."""
    prompts, ref, full = reference
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights, etp=1)
    _check_condition(asyncio.run(server.encode(prompts)), ref, prompts)
    assert asyncio.run(server.shard_workers()) == []
    (own,) = asyncio.run(server.shard_param_bytes())
    assert own["total"] == full.total
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(server.encode(["a prompt as text"]))
    assert e.value.field == "prompts[0]"


@pytest.mark.parametrize("etp", [2, 4])
def test_etp_matches_unsharded_and_workers_die(ray_cluster, tiny_t2i_weights, reference, etp):
    from ray import serve

    prompts, ref, full = reference
    cpus, per_shard = 0.25, 0.25
    opts = {"name": "TextEncoder", "ray_actor_options": {"num_cpus": cpus},
            "graceful_shutdown_wait_loop_s": 0.0, "graceful_shutdown_timeout_s": 2.0,
            **TextEncoderServer.deployment_options(etp, per_shard, cpus,
                                                   shard_memory_bytes=SHARD_MEMORY)}
    app_name = f"etp{etp}"
    handle = serve.run(serve.deployment(TextEncoderServer, **opts).bind(
        "tiny_t2i", tiny_t2i_weights, etp, "cpu"), name=app_name, route_prefix=None)
    try:
        cond = handle.encode.remote(prompts).result(timeout_s=120)
        _check_condition(cond, ref, prompts)
        print(f"etp={etp} max abs diff {(cond['hidden'] - ref['hidden']).abs().max():.2e}")

        with pytest.raises(InvalidRequestError) as e:
            handle.encode.remote([]).result(timeout_s=60)
        assert e.value.field == "prompts"

        shards = handle.shard_param_bytes.remote().result(timeout_s=60)
        assert [s["rank"] for s in shards] == list(range(etp))
        for s in shards:
            assert s["full_sharded"] == full.sharded and s["full_total"] == full.total
            ratio = s["sharded"] / full.sharded
            assert abs(ratio - 1 / etp) < 1e-3, (etp, s)        # vocab split is uneven at 4
            assert s["replicated"] == full.replicated            # LayerNorms, pos. emb., biases
            assert s["replicated"] < 0.02 * full.total
        # the shards add up to the whole; an uneven vocab split (30522 / 4) pads the last
        # shard's storage to the chunk size (at most etp - 1 extra embedding rows)
        extra = sum(s["sharded"] for s in shards) - full.sharded
        assert 0 <= extra <= (etp - 1) * 384 * 4
        print(f"etp={etp} per-shard parameter bytes: "
              f"{[s['total'] for s in shards]} (unsharded {full.total})")

        workers = handle.shard_workers.remote().result(timeout_s=60)
        assert [w["rank"] for w in workers] == list(range(etp))
        assert all(w["memory_limit_bytes"] == SHARD_MEMORY for w in workers)   # each guarded
        pids = [w["pid"] for w in workers]
        assert all(_pid_alive(p) for p in pids)
        assert all(w["replica_pid"] not in pids for w in workers)
        # typed input errors cross the worker boundary unchanged
        too_long = PromptBundle(token_ids=(101,) + (2000,) * 40 + (102,))
        with pytest.raises(LimitExceededError) as e:
            handle.encode.remote([too_long]).result(timeout_s=60)
        assert e.value.field == "prompts[0].token_ids"
        if etp == 2:     # a dead shard fails the request as retryable, never a partial answer
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(ReplicaFailedError) as e:
                handle.encode.remote(prompts).result(timeout_s=120)
            assert e.value.field == "etp_shard_worker" and e.value.retryable
    finally:
        serve.delete(app_name)
    deadline = time.monotonic() + 60
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_pid_alive(p) for p in pids), "shard workers outlived their replica"


def test_clip_and_t5_shard_as_their_plans_declare(ray_cluster, tiny_checkpoint):
    """The tiny SD3 checkpoint's CLIP-L, CLIP-G and T5, each split over 2 gloo ranks by its
    family-declared ETP plan, give the unsharded condition (and each rank holds ~half)."""
    from ray import serve

    from adapters.registry import get_family
    root = str(tiny_checkpoint("sd3"))
    options = {"max_sequence_length": 32}
    family = get_family("sd3", root, options)
    encoders = load_encoders(family)
    prompts = family.conditioner.tokenize(TEXTS)
    ref = family.conditioner.encode(encoders, prompts)
    full = param_bytes(encoders, family)
    opts = {"name": "TextEncoder", "ray_actor_options": {"num_cpus": 0.25},
            "graceful_shutdown_wait_loop_s": 0.0, "graceful_shutdown_timeout_s": 2.0,
            **TextEncoderServer.deployment_options(2, 0.25, 0.25)}
    handle = serve.run(serve.deployment(TextEncoderServer, **opts).bind(
        "sd3", root, 2, "cpu", "float32", options), name="etp_sd3", route_prefix=None)
    try:
        cond = handle.encode.remote(prompts).result(timeout_s=180)
        for name in ("prompt_embeds", "pooled"):
            assert cond[name].shape == ref[name].shape
            assert (cond[name] - ref[name]).abs().max().item() <= 1e-5, name
        assert cond.token_ids == tuple(p.ids_by_encoder(family.spec.encoder_names)
                                       for p in prompts)
        shards = handle.shard_param_bytes.remote().result(timeout_s=60)
        for s in shards:
            assert s["full_sharded"] == full.sharded
            assert abs(s["sharded"] / full.sharded - 0.5) < 0.05, s     # uneven splits round
    finally:
        serve.delete("etp_sd3")
