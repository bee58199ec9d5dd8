"""What the embedded families (tiny_t2i, tiny_t2va) share: weights in this project's own layout
(`adapter.json` + one diffusers `save_pretrained` folder per component, the MiniLM text encoder
from its package), flow-matching sigmas without shift, the packed layout of the vLLM-Omni
engine (fused q/k/v, fc1 in 2 shards ordered (1, 0)), and their guidance rule: with no pipeline
to follow, CFG at any scale but 1 (below 1 interpolates toward the unconditional prompt both
models were trained with, by caption dropout)."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Mapping

import torch
from pydantic import BaseModel
from torch import nn

from adapters import inference_form
from adapters.checkpoint import resolve_dtype
from adapters.family import ModelFamily
from adapters.lora_targets import LoRATargetMap
from adapters.minilm import load_minilm
from contract import ConfigError, GuidanceKind, SamplingSpec
from diffusion.guidance import CFGRule, GuidanceRule
from diffusion.schedule import flow_match_sigmas

ADAPTER_CONFIG = "adapter.json"
EMBEDDED_GUIDANCE = GuidanceRule(GuidanceKind.CFG, CFGRule.NOT_ONE,
                                 source="adapters/embedded.py (the project's own models)")


class EmbeddedFamily(ModelFamily):
    """A family whose weights this project trains and ships. Subclasses declare `components`
    (subfolder -> class), `config_cls` (adapter.json), `shipped` and `packed_lora_map`, and
    build their spec / parts in `set_config`."""

    components: ClassVar[Mapping[str, type]]
    config_cls: ClassVar[type[BaseModel]]
    shipped: ClassVar[Path]
    packed_lora_map: ClassVar[LoRATargetMap]

    def __init__(self, root: str | Path | None = None, config: BaseModel | None = None):
        super().__init__(self.shipped if root is None else root)
        if config is None:
            path = self.root / ADAPTER_CONFIG
            if not path.is_file():
                raise ConfigError(f"{self.shipped.name} weights are incomplete",
                                  field="weights_path",
                                  expected=f"{ADAPTER_CONFIG}, " + ", ".join(self.components),
                                  actual=str(path))
            config = self.config_cls.model_validate_json(path.read_text())
        self.set_config(config)

    def set_config(self, config: BaseModel) -> None:
        raise NotImplementedError

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        return flow_match_sigmas(sampling.num_steps, shift=1.0)

    def load(self, component: str, dtype=torch.float32, device="cpu"):
        dtype = resolve_dtype(dtype, device)
        if component == "text_encoder":
            return load_minilm(self.config.text_encoder, dtype, device)
        if component not in self.components:
            raise ConfigError(f"{self.name} has no such component", field="component",
                              expected=["text_encoder", *self.components], actual=component)
        path = self.root / component
        if not (path / "config.json").is_file():
            raise ConfigError(f"{self.name} weights are incomplete", field="weights_path",
                              expected=str(path / "config.json"), actual=str(self.root))
        module = self.components[component].from_pretrained(path, dtype=dtype)
        return module.to(device).eval().requires_grad_(False)

    def save(self, modules: Mapping[str, nn.Module], path: str | Path) -> None:
        """Write every component (safetensors + config.json) and adapter.json under `path`."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        for name in self.components:
            modules[name].save_pretrained(root / name, safe_serialization=True)
        (root / ADAPTER_CONFIG).write_text(self.config.model_dump_json(indent=2) + "\n")

    def to_inference_form(self, transformer: nn.Module) -> nn.Module:
        """The packed layout (fused q/k/v, fc1 in 2 shards ordered (1, 0)): a converted copy."""
        return inference_form.to_inference_form(transformer, self.packed_lora_map)

    def packed_form(self, component: str, transformer: nn.Module):
        return self.to_inference_form(transformer), self.packed_lora_map
