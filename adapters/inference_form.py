"""Training form -> inference (rollout) form of a DiT, as fast engines lay weights out.

Training form: diffusers modules with separate `to_q`/`to_k`/`to_v` (and `add_*_proj`) and one fc1.
Inference form: q/k/v packed into one `to_qkv` (and `to_added_qkv`) by diffusers' own
`Attention.fuse_projections`, the separate projections removed, and every fc1 split into shards
stored in a declared (possibly permuted) order. The LoRA map (adapters.base.LoRATargetMap) says
how training-side LoRA names land on these packed modules; `check_lora_map` proves every entry
matches modules on both sides, so a sync can never silently match nothing.
"""
from __future__ import annotations

import copy
from typing import Iterator

import torch
from diffusers.models.attention_processor import (Attention, AttnProcessor2_0,
                                                  FusedAttnProcessor2_0,
                                                  FusedJointAttnProcessor2_0,
                                                  JointAttnProcessor2_0)
from torch import nn

from adapters.lora_targets import LoRATargetMap
from contract import ConfigError, LoRAMapError

# Unfused processor class -> its fused twin. Anything else is refused (never silently unfused).
FUSED_PROCESSORS: dict[type, type] = {
    JointAttnProcessor2_0: FusedJointAttnProcessor2_0,
    AttnProcessor2_0: FusedAttnProcessor2_0,
}


class ShardedLinear(nn.Module):
    """A Linear whose output features are split into `num_shards` equal shards.

    Shard module i holds logical output slice `shard_order[i]`; forward returns the slices in
    logical order, so the result equals the unsharded Linear exactly.
    """

    def __init__(self, in_features: int, out_features: int, shard_order: tuple[int, ...],
                 bias: bool = True):
        super().__init__()
        n = len(shard_order)
        if sorted(shard_order) != list(range(n)):
            raise ConfigError("fc1 shard order must be a permutation of range(num_shards)",
                              field="fc1_shard_order", actual=shard_order)
        if out_features % n:
            raise ConfigError("fc1 out_features must divide into the shards", field="fc1_shards",
                              expected=f"divisor of {out_features}", actual=n)
        self.in_features, self.out_features = in_features, out_features
        self.shard_order = tuple(shard_order)
        self.shards = nn.ModuleList(nn.Linear(in_features, out_features // n, bias=bias)
                                    for _ in range(n))
        self._position = [shard_order.index(j) for j in range(n)]   # logical slice -> module idx

    @classmethod
    def from_linear(cls, linear: nn.Linear, shard_order: tuple[int, ...]) -> "ShardedLinear":
        out = cls(linear.in_features, linear.out_features, shard_order, linear.bias is not None)
        out.to(device=linear.weight.device, dtype=linear.weight.dtype)
        width = linear.out_features // len(shard_order)
        with torch.no_grad():
            for i, logical in enumerate(shard_order):
                rows = slice(logical * width, (logical + 1) * width)
                out.shards[i].weight.copy_(linear.weight[rows])
                if linear.bias is not None:
                    out.shards[i].bias.copy_(linear.bias[rows])
        return out

    def logical_shard(self, logical: int) -> nn.Linear:
        return self.shards[self._position[logical]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return torch.cat([self.shards[i](x) for i in self._position], dim=-1)


def modules_with_suffix(model: nn.Module, suffix: str) -> Iterator[tuple[str, nn.Module]]:
    """Modules whose dotted name is `suffix` or ends with `.suffix` (peft's target semantics)."""
    for name, module in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            yield name, module


def to_inference_form(transformer: nn.Module, lora_map: LoRATargetMap) -> nn.Module:
    """Return a converted deep copy: fused q/k/v, sharded fc1. The input is left untouched."""
    model = copy.deepcopy(transformer)
    fused = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Attention):
            continue
        processor_cls = type(module.processor)
        if processor_cls not in FUSED_PROCESSORS:
            raise ConfigError(f"attention {name!r} uses {processor_cls.__name__}, which has no "
                              "fused form", field="processor",
                              expected=[c.__name__ for c in FUSED_PROCESSORS],
                              actual=processor_cls.__name__)
        module.fuse_projections()
        for attr in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            if getattr(module, attr, None) is not None:
                delattr(module, attr)
                setattr(module, attr, None)
        module.set_processor(FUSED_PROCESSORS[processor_cls]())
        fused += 1
    if fused == 0:
        raise LoRAMapError("no attention module to fuse", field="transformer")
    if lora_map.fc1_train_suffix is not None:
        matches = list(modules_with_suffix(model, lora_map.fc1_train_suffix))
        if not matches:
            raise LoRAMapError("fc1 suffix matches no module", field="fc1_train_suffix",
                               actual=lora_map.fc1_train_suffix)
        for name, linear in matches:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ShardedLinear.from_linear(linear, lora_map.fc1_shard_order))
    check_lora_map(transformer, model, lora_map)
    return model


def check_lora_map(training: nn.Module, inference: nn.Module, lora_map: LoRATargetMap) -> None:
    """Every training target and its inference destination must match the same number (> 0)."""
    pairs = [(t.train_suffix, t.infer_suffix) for t in lora_map.targets]
    if lora_map.fc1_train_suffix is not None:
        pairs.append((lora_map.fc1_train_suffix, lora_map.fc1_infer_suffix or
                      lora_map.fc1_train_suffix))
    for train_suffix, infer_suffix in pairs:
        n_train = sum(1 for _ in modules_with_suffix(training, train_suffix))
        n_infer = sum(1 for _ in modules_with_suffix(inference, infer_suffix))
        if n_train == 0 or n_train != n_infer:
            raise LoRAMapError(f"LoRA target {train_suffix!r} -> {infer_suffix!r} matches "
                               f"{n_train} training and {n_infer} inference modules",
                               field="lora_map", expected="same number > 0",
                               actual=(n_train, n_infer))
