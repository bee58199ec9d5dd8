"""LoRA slots on the packed inference form: exact equality with peft merge, typed map errors."""
from __future__ import annotations

import copy

import pytest
import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from adapters.lora_targets import LoRATarget, LoRATargetMap
from adapters.inference_form import to_inference_form
from contract import LoRAMapError, PolicyVersionError
from rollout.lora import BASE_VERSION, LoRASlots

torch.set_num_threads(1)

LORA_MAP = LoRATargetMap(
    targets=(LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
             LoRATarget("attn.to_k", "attn.to_qkv", 1, 3),
             LoRATarget("attn.to_v", "attn.to_qkv", 2, 3),
             LoRATarget("attn.add_k_proj", "attn.to_added_qkv", 1, 3),
             LoRATarget("attn.to_out.0", "attn.to_out.0")),
    fc1_train_suffix="ff.net.0.proj", fc1_infer_suffix="ff.net.0.proj",
    fc1_shards=4, fc1_shard_order=(2, 0, 3, 1))


def _toy_transformer(seed: int = 0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=2,
                                 joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=12, out_channels=4,
                                 pos_embed_max_size=16).eval()


def _peft_lora(base: torch.nn.Module, seed: int, r: int = 4, alpha: int = 8):
    """A peft LoRA with non-zero A and B on the training form; returns (peft model, tensors)."""
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=LORA_MAP.train_target_modules))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model, get_peft_model_state_dict(model)


def _forward(model, x, sigma_time, hidden, pooled):
    return model(hidden_states=x, timestep=sigma_time, encoder_hidden_states=hidden,
                 pooled_projections=pooled, return_dict=False)[0]


@pytest.fixture(scope="module")
def toy():
    train = _toy_transformer()
    infer = to_inference_form(train, LORA_MAP)
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(3, 4, 8, 8, generator=gen), torch.tensor([900.0, 500.0, 20.0]),
              torch.randn(3, 5, 16, generator=gen), torch.randn(3, 12, generator=gen))
    return train, infer, inputs


@torch.no_grad()
def test_slot_equals_peft_merge(toy):
    train, infer, inputs = toy
    slots = LoRASlots(infer, LORA_MAP, max_versions=2)
    peft_a, tensors_a = _peft_lora(train, seed=3)
    peft_b, tensors_b = _peft_lora(train, seed=4)
    slots.load("old", tensors_a, scale=8 / 4)
    slots.load("current", tensors_b, scale=8 / 4)
    merged_a = peft_a.merge_and_unload()
    merged_b = peft_b.merge_and_unload()
    base_out = _forward(train, *inputs)
    with slots.active(BASE_VERSION):
        assert torch.allclose(_forward(infer, *inputs), base_out, atol=1e-5)
    with slots.active("old"):
        out_a = _forward(infer, *inputs)
    with slots.active("current"):
        out_b = _forward(infer, *inputs)
    ref_a, ref_b = _forward(merged_a, *inputs), _forward(merged_b, *inputs)
    assert (out_a - ref_a).abs().max() <= 1e-5
    assert (out_b - ref_b).abs().max() <= 1e-5
    # the LoRA really changes the output (not a no-op) and versions differ from each other
    assert (out_a - base_out).abs().max() > 1e-2
    assert (out_a - out_b).abs().max() > 1e-2
    # after the blocks, the plain model is back to base
    assert torch.allclose(_forward(infer, *inputs), base_out, atol=1e-5)


@torch.no_grad()
def test_copy_protects_a_resident_version_and_handover_keeps_views(toy):
    """Default load copies (a trainer stepping its tensors in place cannot change a resident
    version); copy=False (tensors handed over, e.g. fetched from the object store) keeps views
    and produces the same output."""
    train, infer, inputs = toy
    tensors = _peft_lora(train, seed=6)[1]
    owned = {k: v.clone() for k, v in tensors.items()}
    slots = LoRASlots(infer, LORA_MAP, max_versions=2)
    slots.load("copied", tensors, scale=2.0)
    slots.load("handed", owned, scale=2.0, copy=False)
    with slots.active("copied"):
        out_copied = _forward(infer, *inputs)
    with slots.active("handed"):
        out_handed = _forward(infer, *inputs)
    assert torch.equal(out_copied, out_handed)
    storages = {t.untyped_storage().data_ptr() for t in owned.values()}
    kept = [d for ds in slots._versions["handed"].values() for d in ds]
    assert kept and all(d.a.untyped_storage().data_ptr() in storages for d in kept)
    for value in tensors.values():          # the trainer's next in-place step
        value.mul_(3.0)
    with slots.active("copied"):
        assert torch.equal(_forward(infer, *inputs), out_copied)


def test_lru_eviction_and_pinning(toy):
    train, infer, _ = toy
    slots = LoRASlots(infer, LORA_MAP, max_versions=2)
    tensors = _peft_lora(train, seed=5)[1]
    slots.load("v1", tensors)
    slots.load("v2", tensors)
    with slots.active("v1"):     # v1 becomes most recently used -> v2 is evicted next
        pass
    slots.load("v3", tensors)
    assert slots.versions() == (BASE_VERSION, "v1", "v3")
    assert slots.latest == "v3"
    with pytest.raises(PolicyVersionError):
        slots.load("v4", tensors, pinned=frozenset({"v1", "v3"}))
    with pytest.raises(PolicyVersionError):
        slots.check("v2")
    slots.unload("v1")
    slots.unload("v3")
    assert slots.versions() == (BASE_VERSION,)


def test_unknown_target_names_the_tensor(toy):
    train, infer, _ = toy
    tensors = dict(_peft_lora(train, seed=6)[1])
    tensors["transformer_blocks.0.norm1.linear.lora_A.weight"] = torch.zeros(4, 32)
    tensors["transformer_blocks.0.norm1.linear.lora_B.weight"] = torch.zeros(96, 4)
    with pytest.raises(LoRAMapError) as err:
        LoRASlots(infer, LORA_MAP).load("bad", tensors)
    assert err.value.field == "lora[transformer_blocks.0.norm1.linear]"


def test_zero_match_and_missing_modules(toy):
    _, infer, _ = toy
    slots = LoRASlots(infer, LORA_MAP)
    with pytest.raises(LoRAMapError, match="zero matched"):
        slots.load("empty", {})
    # a declared target whose inference module does not exist (block 7 of a 2-block model)
    with pytest.raises(LoRAMapError, match="does not exist") as err:
        slots.load("ghost", {"transformer_blocks.7.attn.to_q.lora_A.weight": torch.zeros(4, 32),
                             "transformer_blocks.7.attn.to_q.lora_B.weight": torch.zeros(32, 4)})
    assert "transformer_blocks.7.attn.to_q" in err.value.field
    with pytest.raises(LoRAMapError, match="not a peft LoRA weight"):
        slots.load("odd", {"transformer_blocks.0.attn.to_q.weight": torch.zeros(32, 32)})
    assert slots.versions() == (BASE_VERSION,)


def test_shape_mismatch_names_the_tensor(toy):
    train, infer, _ = toy
    tensors = dict(_peft_lora(train, seed=7)[1])
    key = next(k for k in tensors if k.endswith("transformer_blocks.1.attn.to_k.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    with pytest.raises(LoRAMapError) as err:
        LoRASlots(infer, LORA_MAP).load("bad", tensors)
    assert err.value.field == f"lora[{key}]"
    tensors = dict(_peft_lora(train, seed=7)[1])
    key = next(k for k in tensors if k.endswith("transformer_blocks.0.ff.net.0.proj.lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], 7)
    with pytest.raises(LoRAMapError, match="input width") as err:
        LoRASlots(infer, LORA_MAP).load("bad", tensors)
    assert err.value.field == f"lora[{key}]"
