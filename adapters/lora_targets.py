"""Where LoRA targets land: training-form module names -> the modules a rollout engine runs.

The embedded engine serves the training form itself, so its map is the identity over the
family's explicit target list (`LoRATargetMap.identity`). An engine that packs weights (the
vLLM-Omni layout: fused q/k/v, fc1 split into shards in a declared order) gets an explicit map
that says which output slice of which packed module each training target becomes. Every map is
checked against both models (adapters/inference_form.py::check_lora_map) and every sync against
the model (rollout/lora.py): zero matches, unknown names and shape mismatches are errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from contract import ConfigError


@dataclass(frozen=True)
class LoRATarget:
    """One training-form target and its destination.

    train_suffix: module name suffix in the training form (e.g. "attn.to_k").
    infer_suffix: module name suffix in the served model (e.g. "attn.to_qkv").
    slice_index / num_slices: which output slice of the destination (q=0, k=1, v=2 of 3).
    """

    train_suffix: str
    infer_suffix: str
    slice_index: int = 0
    num_slices: int = 1


@dataclass(frozen=True)
class LoRATargetMap:
    """The explicit training -> served map. Training target names are peft target_modules.

    fc1 shards: a packed form splits each fc1 into `fc1_shards` modules whose output slices
    are stored in `fc1_shard_order` (shard i holds logical slice fc1_shard_order[i]).
    """

    targets: tuple[LoRATarget, ...]
    fc1_train_suffix: str | None = None
    fc1_infer_suffix: str | None = None
    fc1_shards: int = 1
    fc1_shard_order: tuple[int, ...] = (0,)

    @classmethod
    def identity(cls, suffixes: Sequence[str]) -> "LoRATargetMap":
        """Each target lands on the module of the same name (the training form is served)."""
        if not suffixes:
            raise ConfigError("a LoRA target list must name at least one module",
                              field="lora_targets", expected="module suffixes", actual=[])
        if len(set(suffixes)) != len(suffixes):
            raise ConfigError("LoRA targets are listed twice", field="lora_targets",
                              actual=list(suffixes))
        return cls(targets=tuple(LoRATarget(s, s) for s in suffixes))

    @property
    def train_target_modules(self) -> list[str]:
        names = [t.train_suffix for t in self.targets]
        if self.fc1_train_suffix is not None:
            names.append(self.fc1_train_suffix)
        return names
