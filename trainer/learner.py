"""The trainer's model side: training-form DiT with peft LoRA, its own text encoder, the optimizer.

Velocities are always returned in the project convention (v = eps - x0, sigma = 1 is noise),
converted once through `diffusion.conventions.predict_velocity` with the adapter's declared
time convention. Text conditions come from the trainer's copy of the encoder run on the exact
token ids that were sent to the graph (never re-tokenized).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch

from adapters.base import Components, DiffusionAdapter, TextCondition
from contract import ConfigError, LoRAMapError, PackedTensors, PromptBundle, Representation
from diffusion.conventions import predict_velocity
from diffusion.guidance import cfg_velocity
from trainer.config import OptimizerConfig
from trainer.lora import (OLD_ADAPTER, TRAIN_ADAPTER, LoRATrainConfig, PolicyRole, attach_lora,
                          export_lora, export_lora_packed, lora_layers, lora_scale,
                          trainable_parameters, use_policy)


def repeat_rows(cond: TextCondition, repeats: Sequence[int]) -> TextCondition:
    """Prompt-level condition (P, ...) -> row-level (sum(repeats), ...)."""
    index = torch.repeat_interleave(torch.arange(len(repeats)), torch.tensor(list(repeats)))
    return cond.index_select(index)


def state_from_latents(adapter: DiffusionAdapter, latents: Mapping[str, torch.Tensor],
                       sampling) -> torch.Tensor:
    """Named latent artifacts -> the sampler state (B, *S), checked by `split_state` round trip.

    One latent is the state itself; several are joined with the adapter's `pack` (declared order).
    """
    names = [s.name for s in adapter.io_spec.artifacts if s.representation == Representation.LATENT]
    missing = [n for n in names if n not in latents]
    if missing:
        raise ConfigError("rollout output lacks latent artifacts the trainer needs",
                          field="requested_artifacts", expected=names, actual=sorted(latents))
    if len(names) == 1:
        state = latents[names[0]]
    elif hasattr(adapter, "pack"):
        state = adapter.pack(*[latents[n] for n in names])
    else:
        raise ConfigError(f"{adapter.name} has several latents and no pack()", field="adapter",
                          actual=names)
    back = adapter.split_state(state, sampling)
    for name in names:
        if not torch.equal(back[name], latents[name]):
            raise ConfigError("split_state(pack(latents)) does not return the latents",
                              field=f"artifacts.{name}", actual=name)
    return state.float()


class Learner:
    """LoRA policy (current / old / reference) on the adapter's training-form transformer."""

    def __init__(self, adapter: DiffusionAdapter, components: Components,
                 lora: LoRATrainConfig, optimizer: OptimizerConfig, seed: int = 0):
        self.adapter = adapter
        self.components = components
        self.transformer = components.transformer.float().eval()
        torch.manual_seed(seed)
        attach_lora(self.transformer, adapter.lora_map, lora)
        self.params = trainable_parameters(self.transformer)
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=optimizer.lr, betas=optimizer.betas,
                                           weight_decay=optimizer.weight_decay, eps=optimizer.eps)
        self._null: TextCondition | None = None

    # ---- conditions -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[PromptBundle]) -> TextCondition:
        """The trainer's own encoder on the ids exactly as sent: (P, L, D)."""
        return self.adapter.encode(self.components.text_encoder, list(prompts))

    def null_condition(self, rows: int) -> TextCondition:
        if self._null is None:
            self._null = self.encode([self.adapter.null_prompt()])
        return repeat_rows(self._null, [rows])

    # ---- forwards -----------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: TextCondition,
                 role: PolicyRole = PolicyRole.CURRENT, guidance_scale: float = 1.0
                 ) -> torch.Tensor:
        """v = eps - x0 of `role` at (x, sigma). x: (B, *S); sigma: (B,). Graph iff CURRENT and
        grad is enabled. With guidance != 1 the unconditional branch (null prompt) is recomputed
        exactly as the rollout forms it."""
        def model_fn(state, model_time, c=cond):
            return self.adapter.model_forward(self.transformer, state, model_time, c)

        with use_policy(self.transformer, role):
            v = predict_velocity(model_fn, x, sigma, self.adapter.time_convention,
                                 self.adapter.model_time_scale)
            if guidance_scale != 1.0:
                null = self.null_condition(x.shape[0])
                v_u = predict_velocity(lambda s, t: model_fn(s, t, null), x, sigma,
                                       self.adapter.time_convention, self.adapter.model_time_scale)
                v = cfg_velocity(v_u, v, guidance_scale)
        return v

    def step(self) -> float:
        """Clip grads, optimizer step, zero grads; returns the pre-clip grad norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---- LoRA tensors -------------------------------------------------------------------------
    def export(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[dict[str, torch.Tensor], float]:
        return export_lora(self.transformer, adapter_name), lora_scale(self.transformer, adapter_name)

    def export_packed(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        """One copy of the adapter's weights into one buffer, ready to publish."""
        return (export_lora_packed(self.transformer, adapter_name),
                lora_scale(self.transformer, adapter_name))

    def load_adapter(self, adapter_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy peft-named tensors (as exported) into one adapter, every layer exactly once."""
        seen = set()
        with torch.no_grad():
            for name, layer in lora_layers(self.transformer):
                for part in ("lora_A", "lora_B"):
                    key = f"{name}.{part}.weight"
                    if key not in tensors:
                        raise LoRAMapError("LoRA tensors lack a layer", field=f"lora[{key}]",
                                           actual=sorted(tensors)[:3])
                    getattr(layer, part)[adapter_name].weight.copy_(tensors[key])
                    seen.add(key)
        extra = sorted(set(tensors) - seen)
        if extra:
            raise LoRAMapError("LoRA tensors name modules the model does not carry",
                               field="lora", actual=extra[:5])

    @contextmanager
    def as_old(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Temporarily hold `tensors` (a published version) in the old adapter."""
        saved = export_lora(self.transformer, OLD_ADAPTER)
        self.load_adapter(OLD_ADAPTER, tensors)
        try:
            yield
        finally:
            self.load_adapter(OLD_ADAPTER, saved)
