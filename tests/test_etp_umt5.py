"""ETP for the T5 family of text encoders on a real local Ray cluster, split by
deployments/etp.py over 2 gloo workers and equal to the unsharded encoder:
  - UMT5 (the tiny Wan 2.1 checkpoint; every layer holds its own relative position bias) through
    the TextEncoder deployment at etp 2, each shard holding half of the split layers;
  - T5 (the tiny FLUX checkpoint's) in 2 Ray actors (the tiny CLIPs' fc1 width 37 does not split,
    so the SD3 / FLUX encoder stages cannot run at etp 2 on them).
T5's `encoder.embed_tokens` is tied to `shared`: both run the one sharded vocab embedding."""
from __future__ import annotations

import pytest
import torch

from adapters.diffusers_parts import (CLIP_TEXT_MODEL_ETP_PLAN, T5_ETP_PLAN, UMT5_ETP_PLAN,
                                      t5_hidden)
from adapters.registry import get_family
from deployments.encoder import TextEncoderServer, load_encoders
from deployments.etp import param_bytes, shard_encoder, tp_plan

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)

TEXTS = ["a red circle", "two blue squares", "cat"]
WAN = {"max_sequence_length": 16}


def test_sharded_umt5_equals_unsharded(ray_cluster, tiny_checkpoint):
    from ray import serve

    root = str(tiny_checkpoint("wan21"))
    family = get_family("wan", root, WAN)
    encoders = load_encoders(family)
    prompts = family.conditioner.tokenize(TEXTS)
    ref = family.conditioner.encode(encoders, prompts)["prompt_embeds"]
    full = param_bytes(encoders, family)
    etp, cpus = 2, 0.25
    opts = {"name": "TextEncoder", "ray_actor_options": {"num_cpus": cpus},
            "graceful_shutdown_wait_loop_s": 0.0, "graceful_shutdown_timeout_s": 2.0,
            **TextEncoderServer.deployment_options(etp, cpus, cpus)}
    handle = serve.run(serve.deployment(TextEncoderServer, **opts).bind(
        "wan", root, etp, "cpu", "float32", WAN), name="etp_umt5", route_prefix=None)
    try:
        cond = handle.encode.remote(prompts).result(timeout_s=180)["prompt_embeds"]
        diff = float((cond - ref).abs().max())
        print(f"UMT5 etp=2: max |sharded - unsharded| = {diff:.3g}")
        assert cond.shape == ref.shape == (3, 16, 32) and diff <= 1e-5
        shards = handle.shard_param_bytes.remote().result(timeout_s=60)
        assert [s["rank"] for s in shards] == [0, 1]
        for s in shards:
            assert s["full_sharded"] == full.sharded and s["full_total"] == full.total
            assert s["sharded"] * etp == full.sharded, s          # vocab and biases included
            assert s["replicated"] == full.replicated             # norms only, no full copy
    finally:
        serve.delete("etp_umt5")


class T5Shard:
    """One ETP rank of a T5 encoder (a Ray actor): the checkpoint's T5, split by the plan."""

    def __init__(self, root: str, rank: int, master: str):
        from datetime import timedelta

        import torch.distributed as dist

        from adapters.checkpoint import load_component
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        self.encoder = shard_encoder(load_component(root, "text_encoder_2"), T5_ETP_PLAN, 2,
                                     "cpu")

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        return t5_hidden(self.encoder, ids).detach()

    def bytes(self) -> tuple[int, int]:
        """(bytes of the embedding and the split layers, total) this rank holds."""
        from torch.distributed.tensor import DTensor
        local = [(p.to_local() if isinstance(p, DTensor) else p.data, isinstance(p, DTensor))
                 for p in self.encoder.parameters()]
        return (sum(t.untyped_storage().nbytes() for t, split in local if split),
                sum(t.untyped_storage().nbytes() for t, _ in local))


def test_sharded_t5_equals_unsharded(ray_cluster, tiny_checkpoint):
    import ray

    from adapters.checkpoint import load_component
    from deployments.encoder import _free_loopback_port
    root = str(tiny_checkpoint("flux"))
    family = get_family("flux", root, {"max_sequence_length": 48})
    t5 = load_component(root, "text_encoder_2")
    ids = family.conditioner.padded("t5", family.conditioner.tokenize(TEXTS))      # (3, 48)
    with torch.no_grad():
        ref = t5_hidden(t5, ids)
    master = f"127.0.0.1:{_free_loopback_port()}"
    actor = ray.remote(num_cpus=0.25)(T5Shard)
    shards = [actor.remote(root, rank, master) for rank in range(2)]
    try:
        outs = ray.get([s.encode.remote(ids) for s in shards], timeout=180)
        held = ray.get([s.bytes.remote() for s in shards], timeout=60)
    finally:
        for s in shards:
            ray.kill(s)
    for out in outs:
        diff = float((out - ref).abs().max())
        print(f"T5 etp=2: max |sharded - unsharded| = {diff:.3g}")
        assert out.shape == ref.shape and diff <= 1e-5
    whole = sum(p.untyped_storage().nbytes() for p in t5.parameters())
    for split, total in held:                    # half of everything but the layer norms
        norms = total - split
        assert split * 2 + norms == whole and norms < 0.02 * whole


def test_plans_name_the_modules_of_their_encoders(tiny_checkpoint):
    """UMT5: relative_attention_bias in every layer (T5: only the first); FLUX's CLIPTextModel
    has no `text_model.` level."""
    family = get_family("wan", tiny_checkpoint("wan21"), WAN)
    assert family.spec.encoders[0].etp is UMT5_ETP_PLAN
    umt5 = load_encoders(family)["umt5"]
    plan = tp_plan(umt5, UMT5_ETP_PLAN)
    assert len([k for k in plan if k.endswith("relative_attention_bias")]) == \
        umt5.config.num_layers == 2
    assert plan.keys() >= {"shared", "encoder.block.1.layer.0.SelfAttention.q",
                           "encoder.block.1.layer.1.DenseReluDense.wo"}
    flux = get_family("flux", tiny_checkpoint("flux"), {"max_sequence_length": 48})
    clip = load_encoders(flux)["clip"]
    plan = tp_plan(clip, CLIP_TEXT_MODEL_ETP_PLAN)
    assert flux.spec.encoder("clip").etp is CLIP_TEXT_MODEL_ETP_PLAN
    assert "embeddings.token_embedding" in plan and "encoder.layers.4.mlp.fc2" in plan
