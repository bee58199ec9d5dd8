"""The training-side LoRA policy: a trained "default" adapter, a sampling "old" adapter, and the
reference (adapters disabled), all on one training-form diffusers transformer.

LoRA (Hu et al. 2021, arXiv 2106.09685, Eq. 3): h = W0 x + (alpha / r) B A x, injected with peft on
the adapter's EXPLICIT targets (`LoRATargetMap.train_target_modules`, never "all-linear").
DiffusionNFT (arXiv 2509.16117) samples with the old adapter and refreshes it from the
trained one by `refresh_old(model, decay)`; FlowGRPO / DPO use "default" and the reference.
`export_lora` produces what the rollout's LoRA slots load: peft-named tensors with training-form
module names (`transformer_blocks.0.attn.to_q.lora_A.weight`) plus one scale = alpha / r.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from enum import Enum
from typing import Iterator

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.lora_targets import LoRATargetMap
from adapters.inference_form import modules_with_suffix
from contract import ConfigError, LoRAMapError, PackedTensors
from trainer.algorithms.nft import ema_update

TRAIN_ADAPTER = "default"
OLD_ADAPTER = "old"


class LoRAInit(str, Enum):
    """peft init of lora_A (lora_B is zero in both, so a new adapter equals the base model)."""

    GAUSSIAN = "gaussian"    # A ~ N(0, 1/r)
    KAIMING = "kaiming"      # A ~ kaiming-uniform (peft's default, init_lora_weights=True)


class LoRATrainConfig(BaseModel):
    """Shape and init of the trained adapter (the old adapter is its copy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(32, ge=1, description="LoRA rank r")
    alpha: float = Field(64.0, gt=0, description="LoRA alpha; the update scale is alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    init: LoRAInit = Field(LoRAInit.GAUSSIAN, description="init of lora_A; lora_B starts at 0")
    init_from: str | None = Field(None, description="a diffusers LoRA file (or folder) as the "
                                  "initial policy; its rank and alpha must equal rank / alpha")
    components: tuple[str, ...] | None = Field(
        None, min_length=1, description="the transformer components that carry the trained "
        "adapter (Wan 2.2: 'transformer' = the high-noise expert, 'transformer_2' = the "
        "low-noise one); the others run with their base weights in every policy. None = all")


class PolicyRole(str, Enum):
    """Which of the three logical policies a forward runs as."""

    CURRENT = "current"      # the trained "default" adapter
    OLD = "old"              # the sampling ("old") adapter
    REFERENCE = "reference"  # base model: adapters disabled


def lora_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """All peft LoRA layers with their module names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def _check_targets(model: nn.Module, targets: list[str]) -> dict[str, int]:
    if not targets:
        raise LoRAMapError("the LoRA map declares no training target", field="train_target_modules",
                           expected="explicit module suffixes", actual=targets)
    if any(t in ("all-linear", "all_linear") for t in targets):
        raise LoRAMapError("targets must be explicit module suffixes, not 'all-linear'",
                           field="train_target_modules", actual=targets)
    counts = {t: sum(1 for _ in modules_with_suffix(model, t)) for t in targets}
    for target, count in counts.items():
        if count == 0:
            raise LoRAMapError(f"LoRA target {target!r} matches no module of the transformer",
                               field="train_target_modules", expected="> 0 matching modules",
                               actual=target)
    return counts


def attach_lora(model: nn.Module, lora_map: LoRATargetMap, config: LoRATrainConfig) -> None:
    """Inject the "default" (trainable) and "old" (frozen copy) adapters on the declared targets.

    Afterwards "default" is active and every base weight is frozen; only the default adapter's
    lora_A / lora_B require grad. Raises LoRAMapError for a target that matches no module.
    """
    if lora_layers(model):
        raise LoRAMapError("the model already carries LoRA layers", field="model",
                           expected="a plain transformer", actual=len(lora_layers(model)))
    targets = list(lora_map.train_target_modules)
    counts = _check_targets(model, targets)
    peft_config = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                             target_modules=targets,
                             init_lora_weights=("gaussian" if config.init is LoRAInit.GAUSSIAN
                                                else True))
    model.requires_grad_(False)
    inject_adapter_in_model(peft_config, model, adapter_name=TRAIN_ADAPTER)
    with warnings.catch_warnings():   # a second adapter on the same model is the intent here
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        inject_adapter_in_model(peft_config, model, adapter_name=OLD_ADAPTER)
    layers = lora_layers(model)
    for target, expected in counts.items():   # peft must have wrapped every matched module
        wrapped = [n for n, layer in layers if (n == target or n.endswith("." + target))
                   and {TRAIN_ADAPTER, OLD_ADAPTER} <= set(layer.lora_A)]
        if len(wrapped) != expected:
            raise LoRAMapError(f"peft wrapped {len(wrapped)} of {expected} modules for {target!r}",
                               field="train_target_modules", expected=expected,
                               actual=len(wrapped))
    for _, layer in layers:
        layer.set_adapter(TRAIN_ADAPTER)      # default trainable, old frozen
    refresh_old(model, 0.0)                   # old starts identical to default


def _adapter_params(model: nn.Module, adapter: str) -> list[torch.nn.Parameter]:
    params = []
    for name, layer in lora_layers(model):
        if adapter not in layer.lora_A:
            raise LoRAMapError(f"adapter {adapter!r} is missing on {name}", field="adapter_name",
                               actual=adapter)
        params += [layer.lora_A[adapter].weight, layer.lora_B[adapter].weight]
    if not params:
        raise LoRAMapError("the model carries no LoRA layer", field="model",
                           expected="attach_lora first", actual=0)
    return params


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """The trained adapter's weights (what the optimizer steps)."""
    return _adapter_params(model, TRAIN_ADAPTER)


def refresh_old(model: nn.Module, decay: float) -> None:
    """old <- decay * old + (1 - decay) * default (decay 0 copies); see nft.old_decay."""
    ema_update(_adapter_params(model, OLD_ADAPTER), _adapter_params(model, TRAIN_ADAPTER), decay)


@contextmanager
def use_policy(model: nn.Module, role: PolicyRole) -> Iterator[None]:
    """Run forwards inside the block as `role`; restores "default" and every requires_grad flag.

    peft's set_adapter / enable_adapters rewrite requires_grad, so the flags are saved and put back:
    the old adapter is never trained by accident.
    """
    role = PolicyRole(role)
    layers = lora_layers(model)
    if not layers:
        raise LoRAMapError("the model carries no LoRA layer", field="model",
                           expected="attach_lora first", actual=0)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for _, layer in layers:
            if role is PolicyRole.REFERENCE:
                layer.enable_adapters(False)
            else:
                layer.set_adapter(OLD_ADAPTER if role is PolicyRole.OLD else TRAIN_ADAPTER)
        yield
    finally:
        for _, layer in layers:
            layer.enable_adapters(True)
            layer.set_adapter(TRAIN_ADAPTER)
        for param, flag in flags:
            param.requires_grad_(flag)


def lora_scale(model: nn.Module, adapter_name: str = TRAIN_ADAPTER) -> float:
    """The single update scale alpha / r of an adapter (checked uniform across layers)."""
    scales = {float(layer.scaling[adapter_name]) for _, layer in lora_layers(model)
              if adapter_name in layer.scaling}
    if len(scales) != 1:
        raise LoRAMapError("adapter scale is missing or not uniform", field="adapter_name",
                           expected="one alpha / r", actual=sorted(scales))
    return scales.pop()


def export_lora_packed(model: nn.Module, adapter_name: str = TRAIN_ADAPTER) -> PackedTensors:
    """peft-format tensors of one adapter with training-form names, copied once into one
    contiguous buffer (what the policy store publishes).

    Keys: `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight` (out, r) for every LoRA
    layer; pair with `lora_scale(model, adapter_name)`.
    """
    if adapter_name not in (TRAIN_ADAPTER, OLD_ADAPTER):
        raise ConfigError("unknown adapter", field="adapter_name",
                          expected=[TRAIN_ADAPTER, OLD_ADAPTER], actual=adapter_name)
    live: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        if adapter_name not in layer.lora_A:
            raise LoRAMapError(f"adapter {adapter_name!r} is missing on {name}",
                               field="adapter_name", actual=adapter_name)
        for part in ("lora_A", "lora_B"):
            live[f"{name}.{part}.weight"] = getattr(layer, part)[adapter_name].weight.detach().cpu()
    if not live:
        raise LoRAMapError("the model carries no LoRA layer", field="model",
                           expected="attach_lora first", actual=0)
    return PackedTensors.pack(live)


def export_lora(model: nn.Module, adapter_name: str = TRAIN_ADAPTER) -> dict[str, torch.Tensor]:
    """`export_lora_packed` as a dict (views into its buffer: detached CPU copies of the
    weights, not aliases of the parameters)."""
    return export_lora_packed(model, adapter_name).unpack()
