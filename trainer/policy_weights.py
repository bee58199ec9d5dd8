"""The learner's three logical policies -- current (trained), old (sampling), reference -- over
the family's transformer(s), for LoRA or full fine-tuning.

    weights = LoRAWeights(models, family, lora_config)   # peft adapters on the base weights
    weights = FullWeights(models, compute_dtype)         # every weight trained, fp32 masters
    with weights.use(PolicyRole.OLD) as models: ...      # the modules to run as that policy
    packed, scale = weights.export_packed("default")     # what a version publishes

LoRA: "default" is trained, "old" is its frozen copy, the reference is the base model (adapters
disabled); base weights may be bf16 / fp16, the adapters are fp32 master weights (peft casts the
input of the low-rank branch). Full: the trained modules hold fp32 master weights and run under
autocast in the compute dtype; old and reference are frozen copies in the compute dtype. Under
FSDP2 every copy is sharded the same way, and exports gather the full tensors (a collective:
every rank calls it).
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Iterator, Mapping

import torch
from torch import nn

from adapters.lora_targets import LoRATargetMap
from contract import ConfigError, LoRAMapError, NonFiniteError, PackedTensors, PolicyKind
from trainer.algorithms.nft import ema_update
from trainer.lora import (OLD_ADAPTER, TRAIN_ADAPTER, LoRATrainConfig, PolicyRole, attach_lora,
                          export_lora_packed, lora_layers, lora_scale, refresh_old,
                          trainable_parameters, use_policy)

Models = dict[str, nn.Module]


class PolicyWeights(ABC):
    kind: PolicyKind
    models: Models                        # the trained (current) modules, by component

    @abstractmethod
    def trainable(self) -> list[nn.Parameter]:
        """What the optimizer steps (fp32)."""

    @abstractmethod
    def use(self, role: PolicyRole):
        """Context manager yielding the modules to run as `role`."""

    @abstractmethod
    def export_packed(self, adapter: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        """One copy of `adapter`'s ("default" or "old") tensors into one buffer + the scale."""

    @abstractmethod
    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy exported tensors into `adapter`, every tensor exactly once."""

    @abstractmethod
    def refresh_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * current."""

    def autocast(self):
        return nullcontext()

    def _prefix(self, component: str) -> str:
        return "" if len(self.models) == 1 else f"{component}."


def _check_adapter(adapter: str) -> None:
    if adapter not in (TRAIN_ADAPTER, OLD_ADAPTER):
        raise LoRAMapError("unknown adapter", field="adapter_name",
                           expected=[TRAIN_ADAPTER, OLD_ADAPTER], actual=adapter)


class LoRAWeights(PolicyWeights):
    kind = PolicyKind.LORA

    def __init__(self, models: Models, lora_targets: Mapping[str, tuple[str, ...]],
                 config: LoRATrainConfig):
        self.models = dict(models)                   # every component the forward runs
        self.trained = _trained(self.models, config.components)
        for name, model in self.trained.items():
            attach_lora(model, LoRATargetMap.identity(lora_targets[name]), config)
            for _, layer in lora_layers(model):          # fp32 master weights on any base dtype
                for part in (layer.lora_A, layer.lora_B):
                    for adapter in (TRAIN_ADAPTER, OLD_ADAPTER):
                        part[adapter].float()

    def trainable(self) -> list[nn.Parameter]:
        return [p for m in self.trained.values() for p in trainable_parameters(m)]

    @contextmanager
    def use(self, role: PolicyRole) -> Iterator[Models]:
        with ExitStack() as stack:
            for model in self.trained.values():
                stack.enter_context(use_policy(model, role))
            yield self.models

    def export_packed(self, adapter: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        _check_adapter(adapter)
        if len(self.models) == 1:
            model = next(iter(self.models.values()))
            return export_lora_packed(model, adapter), lora_scale(model, adapter)
        tensors, scales = {}, set()
        for name, model in self.trained.items():
            part = export_lora_packed(model, adapter).unpack()
            tensors.update({f"{name}.{k}": v for k, v in part.items()})
            scales.add(lora_scale(model, adapter))
        if len(scales) != 1:
            raise LoRAMapError("the transformers' LoRA scales differ", field="lora.scale",
                               actual=sorted(scales))
        return PackedTensors.pack(tensors), scales.pop()

    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        _check_adapter(adapter)
        seen = set()
        with torch.no_grad():
            for component, model in self.trained.items():
                prefix = self._prefix(component)
                for name, layer in lora_layers(model):
                    for part in ("lora_A", "lora_B"):
                        key = f"{prefix}{name}.{part}.weight"
                        if key not in tensors:
                            raise LoRAMapError("LoRA tensors lack a layer", field=f"lora[{key}]",
                                               actual=sorted(tensors)[:3])
                        weight = getattr(layer, part)[adapter].weight
                        _check_exact(tensors[key], weight, f"lora[{key}]")
                        weight.copy_(tensors[key])
                        seen.add(key)
        extra = sorted(set(tensors) - seen)
        if extra:
            raise LoRAMapError("LoRA tensors name modules the model does not carry",
                               field="lora", actual=extra[:5])

    def refresh_old(self, decay: float) -> None:
        for model in self.trained.values():
            refresh_old(model, decay)


def _trained(models: Models, components: tuple[str, ...] | None) -> Models:
    """The components that carry the adapter (`lora.components`; None = all), checked."""
    if components is None:
        return dict(models)
    unknown = [c for c in components if c not in models]
    if unknown or len(set(components)) != len(components):
        raise ConfigError("lora.components names each trained transformer once",
                          field="lora.components", expected=sorted(models),
                          actual=list(components))
    return {name: model for name, model in models.items() if name in components}


def _reshard(model: nn.Module) -> None:
    """FSDP2 leaves a root module that ran a forward without backward (the frozen copies)
    unsharded; its parameters are the sharded DTensors again after `reshard`."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


class FullWeights(PolicyWeights):
    """Every transformer weight trained. `compute_dtype` is what the forwards run in."""

    kind = PolicyKind.FULL

    def __init__(self, models: Models, compute_dtype: torch.dtype = torch.float32):
        self.compute_dtype = compute_dtype
        self.use_autocast = compute_dtype != torch.float32   # FSDP2 casts by its own policy
        self.models = {name: m.float().requires_grad_(True) for name, m in models.items()}
        frozen = lambda: {name: copy.deepcopy(m).to(compute_dtype).requires_grad_(False)  # noqa
                          for name, m in self.models.items()}
        self.roles: dict[PolicyRole, Models] = {PolicyRole.CURRENT: self.models,
                                                PolicyRole.OLD: frozen(),
                                                PolicyRole.REFERENCE: frozen()}

    def trainable(self) -> list[nn.Parameter]:
        return [p for m in self.models.values() for p in m.parameters()]

    @contextmanager
    def use(self, role: PolicyRole) -> Iterator[Models]:
        with self.autocast() if PolicyRole(role) is PolicyRole.CURRENT else nullcontext():
            yield self.roles[PolicyRole(role)]

    def autocast(self):
        if not self.use_autocast:
            return nullcontext()
        device = next(next(iter(self.models.values())).parameters()).device
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def _named(self, adapter: str) -> Iterator[tuple[str, nn.Parameter]]:
        _check_adapter(adapter)
        role = PolicyRole.CURRENT if adapter == TRAIN_ADAPTER else PolicyRole.OLD
        for component, model in self.roles[role].items():
            _reshard(model)
            prefix = self._prefix(component)
            for name, param in model.named_parameters():
                yield prefix + name, param

    @torch.no_grad()
    def export_packed(self, adapter: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        """Full weights in the compute dtype (sharded ones gathered: every rank calls this)."""
        out = {}
        for name, param in self._named(adapter):
            full = param.full_tensor() if _is_dtensor(param) else param
            out[name] = full.detach().to("cpu", self.compute_dtype)
        return PackedTensors.pack(out), 1.0

    @torch.no_grad()
    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor
        seen = set()
        for name, param in self._named(adapter):
            if name not in tensors:
                raise LoRAMapError("full weights lack a parameter", field=f"weights[{name}]",
                                   actual=sorted(tensors)[:3])
            value = tensors[name]
            _check_exact(value, param, f"weights[{name}]")
            if _is_dtensor(param):          # every rank holds the full tensor: keep its shard
                value = distribute_tensor(value.to(param.device, param.dtype),
                                          param.device_mesh, param.placements,
                                          src_data_rank=None)
            param.copy_(value)
            seen.add(name)
        extra = sorted(set(tensors) - seen)
        if extra:
            raise LoRAMapError("full weights name parameters the model does not carry",
                               field="weights", actual=extra[:5])

    def refresh_old(self, decay: float) -> None:
        old = [p for _, p in self._named(OLD_ADAPTER)]
        ema_update(old, [p.detach() for p in self.trainable()], decay)


def _check_exact(value: torch.Tensor, param: torch.Tensor, field: str) -> None:
    """A loaded tensor has exactly the parameter's shape (copy_ would broadcast an (r, 1), (in,)
    or scalar tensor silently) and finite values."""
    if tuple(value.shape) != tuple(param.shape):
        raise LoRAMapError("a loaded tensor has the wrong shape", field=field,
                           expected=tuple(param.shape), actual=tuple(value.shape))
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise NonFiniteError("a loaded tensor holds NaN or Inf", field=field,
                             expected="finite values")
