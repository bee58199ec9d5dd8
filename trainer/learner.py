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

from contextlib import contextmanager
from typing import Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from adapters.family import MediaCondition, ModelFamily
from contract import (Condition, ConfigError, PackedTensors, PolicyKind, PromptBundle,
                      Representation, SamplingSpec)
from diffusion.step import Guidance, doubles_rows, predict_velocity
from trainer.config import OptimizerConfig
from trainer.learner_config import LearnerConfig
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER, LoRATrainConfig, PolicyRole
from trainer.policy_weights import FullWeights, LoRAWeights, PolicyWeights


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


def encode_media_conditions(family: ModelFamily, media_modules: Mapping[str, nn.Module],
                            samplings: Sequence[SamplingSpec],
                            media: Sequence[Mapping | None] | None) -> list[MediaCondition]:
    """Each request's encoded condition media (held state entries, model inputs) as the
    rollout encoded them, recomputed by the same codec from the same media."""
    with torch.no_grad():
        return [family.codec.encode_media(
            media_modules, sampling, dict(media[i] or {}) if media is not None else {})
            for i, sampling in enumerate(samplings)]


def request_inputs(conditions: Sequence[MediaCondition], repeats: Sequence[int]
                   ) -> dict[str, torch.Tensor]:
    """The per-request forward inputs (condition media, position ids) of each request's rows:
    (sum(repeats), ...) each."""
    parts: dict[str, list[torch.Tensor]] = {}
    for condition, rows in zip(conditions, repeats):
        for name, value in condition.inputs.items():
            parts.setdefault(name, []).append(value.cpu().expand(rows, *value.shape[1:]))
    return {name: torch.cat(values) for name, values in parts.items()}


class Learner:
    """The policy (current / old / reference: LoRA adapters or full weights, `settings.
    fine_tune`) on the family's training-form transformer(s), on `settings.device` with the
    transformer weights in `settings.dtype` (trained weights fp32) and the optimizer.

    `collective` is None in one process; a data-parallel worker sets it (trainer/distributed.py)
    so `step` sums the gradients and `reduce_sums` the metric sums of every worker's shard."""

    def __init__(self, family: ModelFamily, transformers: Mapping[str, nn.Module],
                 encoders: Mapping[str, nn.Module], lora: LoRATrainConfig,
                 optimizer: OptimizerConfig, seed: int = 0,
                 media_modules: Mapping[str, nn.Module] | None = None,
                 settings: LearnerConfig | None = None):
        self.family = family
        self.settings = settings or LearnerConfig()
        self.device, self.dtype = self.settings.check_device()
        kind = self.settings.fine_tune
        weights_dtype = torch.float32 if kind is PolicyKind.FULL else self.dtype
        models = {name: m.to(self.device, weights_dtype).eval()
                  for name, m in transformers.items()}
        if self.settings.gradient_checkpointing:
            for name, model in models.items():
                if not getattr(model, "_supports_gradient_checkpointing", False):
                    raise ConfigError("this transformer does not support gradient checkpointing",
                                      field="learner.gradient_checkpointing", expected=False,
                                      actual=f"{name}: {type(model).__name__}")
                model.enable_gradient_checkpointing()
        self.encoders = {k: e.to(self.device) for k, e in encoders.items()}
        self.media_modules = {k: m.to(self.device) for k, m in (media_modules or {}).items()}
        torch.manual_seed(seed)
        self.weights: PolicyWeights = (
            FullWeights(models, self.dtype) if kind is PolicyKind.FULL
            else LoRAWeights(models, family.spec.lora_targets, lora))
        self.models = self.weights.models
        if lora.init_from is not None:
            self.load_initial(lora)
        self.optimizer_config = optimizer
        self.max_grad_norm = optimizer.max_grad_norm
        self.reset_optimizer()
        self.collective: Collective | None = None
        # what the encoder stage's conditions must match (set once from its probe encoding;
        # trainer.rollout_batch.ConditionRows.fetch), None for a learner that encodes its own
        self.condition_signature = None

    def reset_optimizer(self) -> None:
        """A fresh AdamW over the trainable parameters (again after FSDP2 replaced them)."""
        o = self.optimizer_config
        self.params = self.weights.trainable()
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=o.betas,
                                           weight_decay=o.weight_decay, eps=o.eps)

    @property
    def kind(self) -> PolicyKind:
        return self.weights.kind

    @classmethod
    def load(cls, family: ModelFamily, lora: LoRATrainConfig, optimizer: OptimizerConfig,
             seed: int = 0, settings: LearnerConfig | None = None,
             device: str | None = None, text_encoders: bool = True,
             media_encoders: bool = True) -> "Learner":
        """The learner's components from the checkpoint: transformer(s) + text encoders, loaded
        straight onto the device in their dtype (a device or dtype the machine lacks fails
        first, naming the field). `device` overrides `settings.device` (a worker's own GPU).
        text_encoders=False: a learner whose conditions come from the encoder stage by
        reference (a Ray Train worker); media_encoders=False: no task of the run has condition
        media (the VAE encoder re-encodes them)."""
        settings = settings or LearnerConfig()
        if device is not None:
            settings = settings.model_copy(update={"device": device})
        dev, dtype = settings.check_device()
        weights_dtype = torch.float32 if settings.fine_tune is PolicyKind.FULL else dtype
        return cls(family, family.load_transformers(weights_dtype, dev),
                   family.load_encoders(dtype, dev) if text_encoders else {}, lora, optimizer,
                   seed, family.load_media_encoders(dtype, dev) if media_encoders else {},
                   settings)

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
    def encode(self, prompts: Sequence[PromptBundle],
               media: Sequence[Mapping | None] | None = None) -> Condition:
        """The trainer's own encoders on the ids exactly as sent: P rows. `media`: each
        prompt's condition media; those of the roles the conditioner reads itself
        (Conditioner.media_roles, e.g. Qwen-Image-Edit's source image) are encoded with it, as
        the encoder stage encodes them."""
        conditioner = self.family.conditioner
        read = [{r: m[r] for r in conditioner.media_roles if r in m}
                for m in ([dict(m or {}) for m in media] if media is not None else [])]
        if any(read):
            return conditioner.encode_with_media(self.encoders, list(prompts), read).to("cpu")
        return conditioner.encode(self.encoders, list(prompts)).to("cpu")

    def uncond(self, prompts: Sequence[PromptBundle],
               media: Sequence[Mapping | None] | None = None) -> Condition:
        """The unconditional branch of each prompt (its negative, or the null prompt): P rows."""
        conditioner = self.family.conditioner
        return self.encode([conditioner.unconditional(p) for p in prompts], media)

    def conditions(self, prompts: Sequence[PromptBundle], outputs, repeats: Sequence[int],
                   guided: bool, media: Sequence[Mapping | None] | None = None
                   ) -> tuple[Condition, Condition | None]:
        """Each row's condition (and unconditional branch when `guided`) re-encoded by this
        learner's own text encoders (trainer.rollout_batch.build_batch, in-process), with the
        condition media the conditioner reads itself."""
        if not self.encoders:
            raise ConfigError("this learner holds no text encoder: its conditions come from the "
                              "encoder stage (trainer.rollout_batch.StageConditions)",
                              field="encoders", expected=self.family.spec.encoder_names,
                              actual=[])
        cond = self.encode(prompts, media).repeat_rows(repeats)
        return cond, self.uncond(prompts, media).repeat_rows(repeats) if guided else None

    def media_conditions(self, samplings: Sequence[SamplingSpec],
                         media: Sequence[Mapping | None] | None) -> list[MediaCondition]:
        """Each request's encoded condition media (held state entries, model inputs) as the
        rollout encoded them, recomputed by the same codec from the same media."""
        return encode_media_conditions(self.family, self.media_modules, samplings, media)

    @torch.no_grad()
    def forward_inputs(self, samplings: Sequence[SamplingSpec],
                       media: Sequence[Mapping | None] | None, repeats: Sequence[int],
                       conditions: Sequence[MediaCondition] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The per-request forward inputs (condition media, position ids) the rollout computed,
        recomputed by the same codec from the same media (or given as `conditions`):
        (sum(repeats), ...) each."""
        return request_inputs(conditions or self.media_conditions(samplings, media), repeats)

    def guidance(self, rows: int, guidance_scale: float,
                 uncond: Condition | None) -> Guidance:
        """The rollout's guidance for `rows` rows at `guidance_scale` (decided once). Scale 1
        without an unconditional condition is the conditional branch alone (the guidance-free
        velocity NFT and DPO train), even where the rule guides other streams at 1 (LTX-2's
        audio scale)."""
        if guidance_scale == 1.0 and uncond is None:
            return Guidance.conditional(self.family.spec.guidance, rows)
        if not doubles_rows(self.family.spec.guidance, guidance_scale):
            uncond = None
        elif uncond is None:
            raise ConfigError("rows the family's rule guides need their unconditional condition",
                              field="uncond", expected="Condition", actual=None)
        return Guidance.of(self.family.spec.guidance, [guidance_scale] * rows, uncond)

    # ---- forwards -----------------------------------------------------------------------------
    @contextmanager
    def policy(self, role: PolicyRole) -> Iterator[dict[str, nn.Module]]:
        """Forwards inside the block run as `role`; yields the modules to run."""
        with self.weights.use(role) as models:
            yield models

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Condition,
                 role: PolicyRole = PolicyRole.CURRENT, guidance_scale: float = 1.0,
                 uncond: Condition | None = None,
                 media: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """v = eps - x0 of `role` at (x, sigma), guided as the rollout guided it, fp32 on the
        learner's device. x: (B, *S); sigma: (B,); cond / uncond: B rows. Graph iff CURRENT and
        grad is enabled."""
        guidance = self.guidance(x.shape[0], guidance_scale, uncond)
        with self.policy(role) as models:
            return predict_velocity(self.family.denoiser, models, x, sigma, cond, guidance,
                                    media)

    def reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-shard metric sums -> the sums over every worker's shard (identity alone)."""
        return sums if self.collective is None else self.collective.sum_metrics(sums)

    def step(self) -> float:
        """Sum the workers' gradients (data parallel), clip, optimizer step, zero grads;
        returns the pre-clip grad norm."""
        if self.collective is not None:
            self.collective.sum_gradients(self.params)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if hasattr(norm, "full_tensor"):           # FSDP2: the norm of the sharded gradients
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---- policy tensors (LoRA adapters or full weights) -------------------------------------------
    def export(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[dict[str, torch.Tensor], float]:
        packed, scale = self.export_packed(adapter_name)
        return packed.unpack(), scale

    def export_packed(self, adapter_name: str = TRAIN_ADAPTER) -> tuple[PackedTensors, float]:
        """One copy of the adapter's weights into one buffer, ready to publish (names prefixed
        with their component when the family has several transformers). LoRA: A/B + alpha / r;
        full: every transformer weight + 1.0."""
        return self.weights.export_packed(adapter_name)

    def load_adapter(self, adapter_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy exported tensors into one adapter ("default" / "old"), every tensor once."""
        self.weights.load(adapter_name, tensors)

    def refresh_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * current (DiffusionNFT's soft update)."""
        self.weights.refresh_old(decay)

    @contextmanager
    def as_old(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Temporarily hold `tensors` (a published version) in the old adapter."""
        saved, _ = self.export(OLD_ADAPTER)
        self.load_adapter(OLD_ADAPTER, tensors)
        try:
            yield
        finally:
            self.load_adapter(OLD_ADAPTER, saved)


class Collective(Protocol):
    """What a data-parallel worker adds to its Learner (trainer/distributed.py implements it)."""

    def sum_gradients(self, params: list[nn.Parameter]) -> None: ...

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]: ...
