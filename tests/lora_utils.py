"""Random peft-format LoRA tensors on a family's declared targets (for graph/trainer tests)."""
from __future__ import annotations

import torch

from adapters.inference_form import modules_with_suffix


def random_lora(adapter, rank: int = 4, seed: int = 0, std: float = 0.05
                ) -> tuple[dict[str, torch.Tensor], float]:
    """Both A and B random (so the LoRA changes outputs); names as peft saves them."""
    transformer = adapter.load("transformer")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for suffix in adapter.spec.lora_targets["transformer"]:
        for name, module in modules_with_suffix(transformer, suffix):
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features,
                                                           generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank,
                                                           generator=gen) * std
    return tensors, 1.0


def swap_qk(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A broken LoRA map on purpose: each to_q update lands on to_k and vice versa."""
    out = dict(tensors)
    for key in [k for k in tensors if ".attn.to_q." in k]:
        other = key.replace(".attn.to_q.", ".attn.to_k.")
        out[key], out[other] = tensors[other], tensors[key]
    return out
