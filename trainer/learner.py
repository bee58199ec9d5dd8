"""The trainer's model side: the family's training-form transformer(s) with peft LoRA, its text
encoders, the optimizer.

Velocities come from `diffusion.step.predict_velocity` -- the same step function the rollout
engine runs, with the family's denoiser, time convention and guidance decision -- so a row's
velocity here equals the rollout's at the same weights. Conditions are encoded from the exact
token ids that were sent to the graph (never re-tokenized); the unconditional branch of CFG is
the prompt's own negative prompt, or the family's null prompt when it has none, as the graph's
encoder stage forms it.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from adapters.family import ModelFamily
from adapters.lora_targets import LoRATargetMap
from contract import (Condition, ConfigError, LoRAMapError, PackedTensors, PromptBundle,
                      Representation, SamplingSpec)
from diffusion.step import Guidance, doubles_rows, predict_velocity
from trainer.config import OptimizerConfig
from trainer.lora import (OLD_ADAPTER, TRAIN_ADAPTER, LoRATrainConfig, PolicyRole, attach_lora,
                          export_lora_packed, lora_layers, lora_scale, trainable_parameters,
                          use_policy)


def state_from_latents(family: ModelFamily, latents: Mapping[str, torch.Tensor],
                       sampling: SamplingSpec) -> torch.Tensor:
    """Named latent artifacts -> the sampler state (B, *S), checked by a split_state round
    trip (a codec whose join and split disagree would train on the wrong state)."""
    names = [s.name for s in family.io_spec.artifacts
             if s.representation == Representation.LATENT]
    missing = [n for n in names if n not in latents]
    if missing:
        raise ConfigError("rollout output lacks latent artifacts the trainer needs",
                          field="requested_artifacts", expected=names, actual=sorted(latents))
    state = family.codec.join_state({n: latents[n] for n in names}, sampling)
    back = family.codec.split_state(state, sampling)
    for name in names:
        if not torch.equal(back[name].float(), latents[name].float()):
            raise ConfigError("split_state(join_state(latents)) does not return the latents",
                              field=f"artifacts.{name}", actual=name)
    return state.float()


class Learner:
    """LoRA policy (current / old / reference) on the family's training-form transformer(s)."""

    def __init__(self, family: ModelFamily, transformers: Mapping[str, nn.Module],
                 encoders: Mapping[str, nn.Module], lora: LoRATrainConfig,
                 optimizer: OptimizerConfig, seed: int = 0,
                 media_modules: Mapping[str, nn.Module] | None = None):
        self.family = family
        self.models = {name: m.float().eval() for name, m in transformers.items()}
        self.encoders = dict(encoders)
        self.media_modules = dict(media_modules or {})
        torch.manual_seed(seed)
        for name, model in self.models.items():
            attach_lora(model, LoRATargetMap.identity(family.spec.lora_targets[name]), lora)
        if lora.init_from is not None:
            self.load_initial(lora)
        self.params = [p for m in self.models.values() for p in trainable_parameters(m)]
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=optimizer.lr, betas=optimizer.betas,
                                           weight_decay=optimizer.weight_decay, eps=optimizer.eps)

    @classmethod
    def load(cls, family: ModelFamily, lora: LoRATrainConfig, optimizer: OptimizerConfig,
             seed: int = 0) -> "Learner":
        """The learner's components from the checkpoint: transformer(s) + text encoders."""
        return cls(family, family.load_transformers(), family.load_encoders(), lora, optimizer,
                   seed, family.load_media_encoders())

    def load_initial(self, lora: LoRATrainConfig) -> None:
        """A user's diffusers LoRA file as the trained and the old adapter (the reference stays
        the base model). Rank and scale must be the configured ones, every layer covered."""
        from adapters.lora_files import load_diffusers_lora
        tensors, scale = load_diffusers_lora(self.family, lora.init_from)
        rank = {t.shape[0] for k, t in tensors.items() if ".lora_A." in k}.pop()
        if rank != lora.rank or abs(scale - lora.alpha / lora.rank) > 1e-6:
            raise ConfigError("the initial LoRA's rank / scale differ from the config",
                              field="lora.rank", expected=(lora.rank, lora.alpha / lora.rank),
                              actual=(rank, scale))
        self.load_adapter(TRAIN_ADAPTER, tensors)
        self.load_adapter(OLD_ADAPTER, tensors)

    @property
    def transformer(self) -> nn.Module:
        """The one transformer of a single-transformer family."""
        if len(self.models) != 1:
            raise ConfigError("this family has several transformers; name one",
                              field="component", expected=sorted(self.models))
        return next(iter(self.models.values()))

    # ---- conditions -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[PromptBundle]) -> Condition:
        """The trainer's own encoders on the ids exactly as sent: P rows."""
        return self.family.conditioner.encode(self.encoders, list(prompts)).to("cpu")

    def uncond(self, prompts: Sequence[PromptBundle]) -> Condition:
        """The unconditional branch of each prompt (its negative, or the null prompt): P rows."""
        conditioner = self.family.conditioner
        return self.encode([conditioner.unconditional(p) for p in prompts])

    @torch.no_grad()
    def forward_inputs(self, samplings: Sequence[SamplingSpec],
                       media: Sequence[Mapping | None] | None,
                       repeats: Sequence[int]) -> dict[str, torch.Tensor]:
        """The per-request forward inputs (condition media, position ids) the rollout computed,
        recomputed by the same codec from the same media: (sum(repeats), ...) each."""
        parts: dict[str, list[torch.Tensor]] = {}
        for i, (sampling, rows) in enumerate(zip(samplings, repeats)):
            given = dict(media[i] or {}) if media is not None else {}
            inputs = self.family.codec.encode_media(self.media_modules, sampling, given).inputs
            for name, value in inputs.items():
                parts.setdefault(name, []).append(value.expand(rows, *value.shape[1:]))
        return {name: torch.cat(values) for name, values in parts.items()}

    def guidance(self, rows: int, guidance_scale: float,
                 uncond: Condition | None) -> Guidance:
        """The rollout's guidance for `rows` rows at `guidance_scale` (decided once)."""
        if not doubles_rows(self.family.spec.guidance, guidance_scale):
            uncond = None
        elif uncond is None:
            raise ConfigError("guidance_scale != 1 needs the rows' unconditional condition",
                              field="uncond", expected="Condition", actual=None)
        return Guidance.of(self.family.spec.guidance, [guidance_scale] * rows, uncond)

    # ---- forwards -----------------------------------------------------------------------------
    @contextmanager
    def policy(self, role: PolicyRole) -> Iterator[None]:
        with ExitStack() as stack:
            for model in self.models.values():
                stack.enter_context(use_policy(model, role))
            yield

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Condition,
                 role: PolicyRole = PolicyRole.CURRENT, guidance_scale: float = 1.0,
                 uncond: Condition | None = None,
                 media: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """v = eps - x0 of `role` at (x, sigma), guided as the rollout guided it. x: (B, *S);
        sigma: (B,); cond / uncond: B rows. Graph iff CURRENT and grad is enabled."""
        guidance = self.guidance(x.shape[0], guidance_scale, uncond)
        with self.policy(role):
            return predict_velocity(self.family.denoiser, self.models, x, sigma, cond, guidance,
                                    media)

    def step(self) -> float:
        """Clip grads, optimizer step, zero grads; returns the pre-clip grad norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---- LoRA tensors -------------------------------------------------------------------------
    def _prefix(self, name: str) -> str:
        return "" if len(self.models) == 1 else f"{name}."

    def export(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[dict[str, torch.Tensor], float]:
        packed, scale = self.export_packed(adapter_name)
        return packed.unpack(), scale

    def export_packed(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        """One copy of the adapter's weights into one buffer, ready to publish (names prefixed
        with their component when the family has several transformers)."""
        if len(self.models) == 1:
            model = self.transformer
            return export_lora_packed(model, adapter_name), lora_scale(model, adapter_name)
        tensors, scales = {}, set()
        for name, model in self.models.items():
            part = export_lora_packed(model, adapter_name).unpack()
            tensors.update({f"{name}.{k}": v for k, v in part.items()})
            scales.add(lora_scale(model, adapter_name))
        if len(scales) != 1:
            raise LoRAMapError("the transformers' LoRA scales differ", field="lora.scale",
                               actual=sorted(scales))
        return PackedTensors.pack(tensors), scales.pop()

    def load_adapter(self, adapter_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy exported tensors into one adapter, every layer exactly once."""
        seen = set()
        with torch.no_grad():
            for component, model in self.models.items():
                prefix = self._prefix(component)
                for name, layer in lora_layers(model):
                    for part in ("lora_A", "lora_B"):
                        key = f"{prefix}{name}.{part}.weight"
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
        saved, _ = self.export(OLD_ADAPTER)
        self.load_adapter(OLD_ADAPTER, tensors)
        try:
            yield
        finally:
            self.load_adapter(OLD_ADAPTER, saved)
