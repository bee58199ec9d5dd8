"""LoRA for the vLLM-Omni engine: validation, the on-disk hand-off, and worker-side activation.

vLLM-Omni's own LoRA manager only wraps vLLM parallel-linear layers, so a DiT built from plain
`nn.Linear` would get nothing from it (and its `_load_adapter` refuses such a pipeline). The
pipeline therefore sets `lora_is_fused = True` (the worker then skips the manager and passes
`sampling_params.lora_request` through untouched) and applies the adapter itself with peft on
the training-form transformer: exactly the modules and names the trainer's peft model uses.

Hand-off: the client writes a peft directory (adapter_config.json + adapter_model.safetensors)
and sends `LoRARequest(lora_name=version, lora_int_id=<new id per version>, lora_path=dir)`;
the worker loads it lazily on the first request with that id and keeps an LRU of resident ids.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from adapters.lora_targets import LoRATargetMap
from contract import LoRAMapError

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
WEIGHTS_FILE = "adapter_model.safetensors"


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def lora_module_shapes(transformer: nn.Module, lora_map: LoRATargetMap) -> dict[str, tuple[int, int]]:
    """Training-form Linear modules the map targets: name -> (out_features, in_features)."""
    suffixes = lora_map.train_target_modules
    shapes = {name: (m.out_features, m.in_features) for name, m in transformer.named_modules()
              if isinstance(m, nn.Linear) and any(_matches(name, s) for s in suffixes)}
    if not shapes:
        raise LoRAMapError("the LoRA map matches zero modules of the transformer",
                           field="lora_map.targets", expected=suffixes, actual=0)
    return shapes


def check_lora_tensors(tensors: Mapping[str, torch.Tensor],
                       modules: Mapping[str, tuple[int, int]],
                       lora_map: LoRATargetMap) -> int:
    """Validate peft-format tensors (`<module>.lora_A.weight` (r, in), `.lora_B.weight` (out, r))
    against the targetable modules. Returns the rank. Every problem names the tensor."""
    if not tensors:
        raise LoRAMapError("LoRA has no tensors, it would match zero modules", field="tensors",
                           actual=0)
    ranks: dict[str, int] = {}
    seen: dict[str, set[str]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoRAMapError("not a peft LoRA tensor name", field=f"tensors.{key}",
                               expected=f"<module>{{{', '.join(_SUFFIXES)}}}", actual=key)
        module = key[: -len(suffix)]
        if not any(_matches(module, s) for s in lora_map.train_target_modules):
            raise LoRAMapError("LoRA target is not in the adapter's LoRA map",
                               field=f"tensors.{key}", expected=lora_map.train_target_modules,
                               actual=module)
        if module not in modules:
            raise LoRAMapError("LoRA tensor matches no module of the transformer",
                               field=f"tensors.{key}", actual=module)
        out_f, in_f = modules[module]
        is_a = suffix == _SUFFIXES[0]
        rank = tensor.shape[0] if is_a else tensor.shape[1]
        want = (rank, in_f) if is_a else (out_f, rank)
        if tensor.ndim != 2 or tuple(tensor.shape) != want:
            raise LoRAMapError("LoRA tensor shape does not fit its module", field=f"tensors.{key}",
                               expected=want, actual=tuple(tensor.shape))
        ranks[key] = int(rank)
        seen.setdefault(module, set()).add(suffix)
    for module, parts in seen.items():
        if len(parts) != 2:
            raise LoRAMapError("LoRA module needs both lora_A and lora_B", field=f"tensors.{module}",
                               expected=list(_SUFFIXES), actual=sorted(parts))
    if len(set(ranks.values())) != 1:
        raise LoRAMapError("LoRA tensors disagree on the rank", field="tensors",
                           actual=sorted(set(ranks.values())))
    return next(iter(ranks.values()))


def write_peft_dir(path: Path, tensors: Mapping[str, torch.Tensor], rank: int, scale: float) -> None:
    """Write a peft adapter directory; lora_alpha = scale * r so peft's alpha/r equals `scale`."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    path.mkdir(parents=True, exist_ok=False)
    LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=modules,
               lora_dropout=0.0).save_pretrained(str(path))
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
              str(path / WEIGHTS_FILE))


class ResidentLoRAs:
    """Worker side: peft adapters on the transformer, keyed by lora_int_id, LRU-bounded."""

    def __init__(self, transformer: nn.Module, lora_map: LoRATargetMap, max_resident: int):
        self.transformer = transformer
        self.lora_map = lora_map
        self.max_resident = max_resident
        self.modules = lora_module_shapes(transformer, lora_map)
        self._names: OrderedDict[int, str] = OrderedDict()

    def activate(self, lora_request) -> int:
        """Make `lora_request` (or the base model for None) active. Returns the active id (0 =
        base)."""
        if lora_request is None:
            if self._names:
                self.transformer.disable_adapters()
            return 0
        lora_id = int(lora_request.lora_int_id)
        if lora_id not in self._names:
            self._load(lora_id, Path(lora_request.lora_path))
        self._names.move_to_end(lora_id)
        self.transformer.set_adapter(self._names[lora_id])
        self.transformer.enable_adapters()
        return lora_id

    def _load(self, lora_id: int, path: Path) -> None:
        from peft import LoraConfig, set_peft_model_state_dict
        from safetensors.torch import load_file

        config = LoraConfig(**{k: v for k, v in json.loads(
            (path / "adapter_config.json").read_text()).items()
            if k in ("r", "lora_alpha", "target_modules", "lora_dropout")})
        param = next(self.transformer.parameters())
        tensors = {k: v.to(param.device, param.dtype)
                   for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
        check_lora_tensors(tensors, self.modules, self.lora_map)
        name = f"lora_{lora_id}"
        self.transformer.add_adapter(config, adapter_name=name)
        result = set_peft_model_state_dict(self.transformer, tensors, adapter_name=name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            self.transformer.delete_adapters(name)
            raise LoRAMapError("peft did not place every LoRA tensor", field="tensors",
                               actual=unexpected[:5])
        self._names[lora_id] = name
        while len(self._names) > self.max_resident:
            _, old = self._names.popitem(last=False)
            self.transformer.delete_adapters(old)
