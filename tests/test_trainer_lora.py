"""Training-side LoRA policy on a toy diffusers SD3Transformer2DModel (real peft injection)."""
from __future__ import annotations

import copy

import pytest
import torch
from diffusers import SD3Transformer2DModel

from adapters.lora_targets import LoRATarget, LoRATargetMap
from adapters.inference_form import to_inference_form
from contract import LoRAMapError
from rollout.lora import LoRASlots
from trainer.algorithms import nft_loss
from trainer.lora import (LoRATrainConfig, PolicyRole, attach_lora, export_lora, lora_layers,
                          lora_scale, refresh_old, trainable_parameters, use_policy)

LORA_MAP = LoRATargetMap(
    targets=(LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
             LoRATarget("attn.to_k", "attn.to_qkv", 1, 3),
             LoRATarget("attn.to_v", "attn.to_qkv", 2, 3),
             LoRATarget("attn.add_q_proj", "attn.to_added_qkv", 0, 3),
             LoRATarget("attn.to_out.0", "attn.to_out.0")),
    fc1_train_suffix="ff.net.0.proj", fc1_infer_suffix="ff.net.0.proj", fc1_shards=2,
    fc1_shard_order=(1, 0))
CONFIG = LoRATrainConfig(rank=4, alpha=8.0)


def _tiny_transformer() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=2,
                                 joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)


def _inputs(batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, 8, 8, generator=gen),
                encoder_hidden_states=torch.randn(batch, 5, 16, generator=gen),
                pooled_projections=torch.randn(batch, 8, generator=gen),
                timestep=torch.tensor([700.0, 300.0][:batch]))


def _forward(model, role, inputs):
    with use_policy(model, role), torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _nft_step(model, inputs, lr=1e-2):
    """One real DiffusionNFT optimizer step (old samples, default trains, reference KL)."""
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    gen = torch.Generator().manual_seed(7)
    x0 = torch.randn(2, 4, 8, 8, generator=gen)
    eps = torch.randn(2, 4, 8, 8, generator=gen)
    sigma = inputs["timestep"] / 1000.0
    s = sigma.view(2, 1, 1, 1)
    x_sigma = (1 - s) * x0 + s * eps
    step_inputs = dict(inputs, hidden_states=x_sigma)
    v_old = _forward(model, PolicyRole.OLD, step_inputs)
    v_ref = _forward(model, PolicyRole.REFERENCE, step_inputs)
    with use_policy(model, PolicyRole.CURRENT):
        v_theta = model(**step_inputs, return_dict=False)[0]
    out = nft_loss(v_theta, v_old, x_sigma, x0, sigma, torch.tensor([1.0, 0.0]), beta=0.5,
                   adv_clip_max=5.0, v_ref=v_ref, ref_kl_coef=1e-4)
    opt.zero_grad()
    out.loss.backward()
    opt.step()


def test_export_keys_match_declared_targets():
    model = _tiny_transformer()
    attach_lora(model, LORA_MAP, CONFIG)
    tensors = export_lora(model)
    modules = {k.rsplit(".lora_", 1)[0] for k in tensors}
    targets = LORA_MAP.train_target_modules
    expected = {n for n, _ in model.named_modules()
                if any(n.endswith("." + t) for t in targets) and ".base_layer" not in n
                and ".lora_" not in n}
    assert modules == expected and len(expected) >= 2 * len(targets) - 1
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in tensors
    assert set(tensors) == {f"{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    a, b = tensors["transformer_blocks.0.attn.to_q.lora_A.weight"], \
        tensors["transformer_blocks.0.attn.to_q.lora_B.weight"]
    assert a.shape == (4, 16) and b.shape == (16, 4)
    assert lora_scale(model) == 2.0
    # only the default adapter is trainable; base weights frozen
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    assert len(trainable) == len(tensors)


def test_gradient_step_changes_current_but_not_reference_or_old():
    model = _tiny_transformer()
    base = copy.deepcopy(model)
    attach_lora(model, LORA_MAP, CONFIG)
    inputs = _inputs()
    with torch.no_grad():
        base_out = base(**inputs, return_dict=False)[0]
    before = _forward(model, PolicyRole.CURRENT, inputs)
    torch.testing.assert_close(before, base_out)          # B = 0 init: LoRA starts at the base
    _nft_step(model, inputs)
    current = _forward(model, PolicyRole.CURRENT, inputs)
    assert (current - base_out).abs().max() > 1e-4
    torch.testing.assert_close(_forward(model, PolicyRole.REFERENCE, inputs), base_out)
    torch.testing.assert_close(_forward(model, PolicyRole.OLD, inputs), base_out)
    old_grads = [layer.lora_B["old"].weight.grad for _, layer in lora_layers(model)]
    assert all(g is None for g in old_grads)                # old never trained
    assert all(not layer.lora_B["old"].weight.requires_grad for _, layer in lora_layers(model))


def test_refresh_old_with_decay_zero_copies_default():
    model = _tiny_transformer()
    attach_lora(model, LORA_MAP, CONFIG)
    inputs = _inputs()
    _nft_step(model, inputs)
    current = _forward(model, PolicyRole.CURRENT, inputs)
    assert (current - _forward(model, PolicyRole.OLD, inputs)).abs().max() > 1e-4
    refresh_old(model, 0.0)
    torch.testing.assert_close(_forward(model, PolicyRole.OLD, inputs), current)
    assert export_lora(model, "old").keys() == export_lora(model).keys()


def test_export_loads_into_rollout_slots_with_identical_output():
    model = _tiny_transformer()
    inference = to_inference_form(model, LORA_MAP)
    attach_lora(model, LORA_MAP, CONFIG)
    inputs = _inputs()
    _nft_step(model, inputs)
    slots = LoRASlots(inference, LORA_MAP)
    slots.load("v1", export_lora(model), scale=lora_scale(model))
    with slots.active("v1"), torch.no_grad():
        served = inference(**inputs, return_dict=False)[0]
    torch.testing.assert_close(served, _forward(model, PolicyRole.CURRENT, inputs),
                               rtol=1e-5, atol=1e-5)


def test_target_matching_nothing_fails():
    bad = LoRATargetMap(targets=(LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
                                 LoRATarget("attn.to_query", "attn.to_qkv", 1, 3)))
    model = _tiny_transformer()
    with pytest.raises(LoRAMapError, match="to_query"):
        attach_lora(model, bad, CONFIG)
    assert not lora_layers(model)                         # nothing half-attached
    with pytest.raises(LoRAMapError, match="all-linear"):
        attach_lora(model, LoRATargetMap(targets=(LoRATarget("all-linear", "x"),)), CONFIG)
    with pytest.raises(LoRAMapError, match="no LoRA layer"):
        export_lora(model)
