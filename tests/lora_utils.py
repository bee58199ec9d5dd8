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
