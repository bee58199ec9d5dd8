"""ETP for UMT5 (Wan's text encoder) on a real local Ray cluster: the tiny Wan 2.1 checkpoint's
UMT5, whose every layer holds its own relative position bias, split by deployments/etp.py over
2 gloo workers through the TextEncoder deployment, equal to the unsharded encoder, each shard
holding half of the split layers and no full copy of the vocab embedding (T5's
`encoder.embed_tokens` is tied to `shared`: both run the one sharded module). T5 itself is
sharded in tests/test_etp.py (the tiny SD3 checkpoint's encoders)."""
from __future__ import annotations

import pytest
import torch

from adapters.diffusers_parts import CLIP_TEXT_MODEL_ETP_PLAN, UMT5_ETP_PLAN
from adapters.registry import get_family
from deployments.encoder import TextEncoderServer, load_encoders
from deployments.etp import param_bytes, tp_plan

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
