"""The text-encoder stage's work, used by the replica (etp 1) and by each ETP shard worker:
load a family's text encoders (inputs placed on their device) and encode prompts' ids."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from adapters.family import ModelFamily
from contract import Condition, PromptBundle


def load_encoders(family: ModelFamily, device: torch.device | str = "cpu",
                  dtype: str = "float32") -> dict[str, nn.Module]:
    """The family's text encoders only (name -> module), inputs placed on `device`."""
    device = torch.device(device)
    return {name: place_inputs_on(module, device)
            for name, module in family.load_encoders(dtype, device).items()}


def place_inputs_on(encoder: nn.Module, device: torch.device) -> nn.Module:
    """Move the encoder's tensor inputs to `device` (the conditioner pads ids on the CPU)."""
    def hook(module, args, kwargs):
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v   # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    if device.type != "cpu":
        encoder.register_forward_pre_hook(hook, with_kwargs=True)
    return encoder


def encode_prompts(family: ModelFamily, encoders, prompts: Sequence[PromptBundle]) -> Condition:
    """The conditioner on the ids exactly as given; `token_ids` records, per prompt, the ids of
    every encoder (what the trainer's token check compares)."""
    cond = family.conditioner.encode(encoders, prompts).to("cpu")
    names = family.spec.encoder_names
    return Condition(cond.tensors, tuple(p.ids_by_encoder(names) for p in prompts))
