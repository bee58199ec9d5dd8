"""ETP for Qwen2.5-VL (Qwen-Image's text encoder) on a real local Ray cluster: the tiny
Qwen-Image checkpoint's Qwen2_5_VLForConditionalGeneration (4 query heads over 2 key/value
heads) split by deployments/etp.py over 2 gloo workers through the TextEncoder deployment,
equal to the unsharded encoder (masked embeddings included), each shard holding half of the
split layers; the vision tower and the norms stay replicated."""
from __future__ import annotations

import pytest
import torch

from adapters.qwen_image import QWEN2_5_VL_ETP_PLAN
from adapters.registry import get_family
from contract import ConfigError
from deployments.encoder import TextEncoderServer, load_encoders
from deployments.etp import check_family_etp, param_bytes, tp_plan

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)

TEXTS = ["a red circle", "two blue squares under a green sky", "cat"]
QWEN = {"max_sequence_length": 32}


def test_sharded_qwen2_5_vl_equals_unsharded(ray_cluster, tiny_checkpoint):
    from ray import serve

    root = str(tiny_checkpoint("qwen_image"))
    family = get_family("qwen_image", root, QWEN)
    encoders = load_encoders(family)
    prompts = family.conditioner.tokenize(TEXTS)
    ref = family.conditioner.encode(encoders, prompts)
    full = param_bytes(encoders, family)
    etp, cpus = 2, 0.25
    opts = {"name": "TextEncoder", "ray_actor_options": {"num_cpus": cpus},
            "graceful_shutdown_wait_loop_s": 0.0, "graceful_shutdown_timeout_s": 2.0,
            **TextEncoderServer.deployment_options(etp, cpus, cpus)}
    handle = serve.run(serve.deployment(TextEncoderServer, **opts).bind(
        "qwen_image", root, etp, "cpu", "float32", QWEN), name="etp_qwen", route_prefix=None)
    try:
        cond = handle.encode.remote(prompts).result(timeout_s=180)
        diff = float((cond["prompt_embeds"] - ref["prompt_embeds"]).abs().max())
        print(f"Qwen2.5-VL etp=2: max |sharded - unsharded| = {diff:.3g}")
        assert cond["prompt_embeds"].shape == ref["prompt_embeds"].shape == (3, 32, 32)
        assert diff <= 1e-5 and torch.equal(cond["prompt_mask"], ref["prompt_mask"])
        shards = handle.shard_param_bytes.remote().result(timeout_s=60)
        assert [s["rank"] for s in shards] == [0, 1]
        for s in shards:
            assert s["full_sharded"] == full.sharded and s["full_total"] == full.total
            assert s["sharded"] * etp == full.sharded, s
            assert s["replicated"] == full.replicated        # vision tower, norms, lm head
    finally:
        serve.delete("etp_qwen")


def test_the_plan_names_the_encoders_modules_and_its_kv_heads_bound_etp(tiny_checkpoint):
    """Column q / k / v (with biases) and gate / up, row o / down in every language-model
    layer and the vocab-split embedding; etp must divide the 2 key/value heads."""
    family = get_family("qwen_image", tiny_checkpoint("qwen_image"), QWEN)
    assert family.spec.encoder("qwen").etp is QWEN2_5_VL_ETP_PLAN
    plan = tp_plan(load_encoders(family)["qwen"], QWEN2_5_VL_ETP_PLAN, 2)
    assert plan.keys() == {"model.language_model.embed_tokens"} | {
        f"model.language_model.layers.{i}.{name}" for i in range(2)
        for name in (*QWEN2_5_VL_ETP_PLAN.column, *QWEN2_5_VL_ETP_PLAN.row)}
    assert check_family_etp(family, 2) == 2
    with pytest.raises(ConfigError) as err:
        check_family_etp(family, 4)                   # 4 does not divide 2 key/value heads
    assert err.value.field == "etp" and err.value.expected == [1, 2]
