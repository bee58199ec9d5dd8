"""The adapter seam: what a model family must declare and provide.

An adapter owns model-specific knowledge only: components, IO spec, time convention, LoRA target
map, prompt/token rules and how the sampler state packs into named latents. The sampler math lives
in `diffusion/`, the engine loop in `rollout/`. Adapters are registered explicitly in
`adapters/registry.py` (no import side effects).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from contract import (InvalidRequestError, IOSpec, MediaRole, PromptBundle, RequestLimits,
                      RolloutRequest, SamplingSpec, Task, TimeConvention, check_limits,
                      normalize_media)


@dataclass(frozen=True)
class TextCondition:
    """Encoder output for B prompts. hidden: (B, L, D); mask: (B, L) bool; pooled: (B, P) or None."""

    hidden: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None   # the ids the encoder saw, per prompt

    def index_select(self, rows: torch.Tensor) -> "TextCondition":
        ids = None if self.token_ids is None else tuple(self.token_ids[i] for i in rows.tolist())
        return TextCondition(self.hidden[rows], self.mask[rows],
                             None if self.pooled is None else self.pooled[rows], ids)


@dataclass(frozen=True)
class LoRATarget:
    """Where one training-form LoRA target lands in the inference-form model.

    train_suffix: module name suffix in the training form (e.g. "attn.to_k").
    infer_suffix: module name suffix of the packed inference module (e.g. "attn.to_qkv").
    slice_index / num_slices: which output slice of the packed module (q=0, k=1, v=2 of 3).
    """

    train_suffix: str
    infer_suffix: str
    slice_index: int = 0
    num_slices: int = 1


@dataclass(frozen=True)
class LoRATargetMap:
    """The explicit training -> inference map. Training target names are peft target_modules.

    fc1 shards: the inference form splits each fc1 into `fc1_shards` modules whose output slices
    are stored in `fc1_shard_order` (shard i holds logical slice fc1_shard_order[i]).
    """

    targets: tuple[LoRATarget, ...]
    fc1_train_suffix: str | None = None
    fc1_infer_suffix: str | None = None
    fc1_shards: int = 1
    fc1_shard_order: tuple[int, ...] = (0,)

    @property
    def train_target_modules(self) -> list[str]:
        names = [t.train_suffix for t in self.targets]
        if self.fc1_train_suffix is not None:
            names.append(self.fc1_train_suffix)
        return names


@dataclass
class Components:
    """Loaded modules of one adapter (eval mode, fp32 on CPU by default)."""

    text_encoder: nn.Module
    transformer: nn.Module                 # training form (diffusers-style to_q/to_k/to_v, fc1)
    decoders: dict[str, nn.Module]         # latent artifact name -> VAE (decode side used)
    extra: dict[str, object] = field(default_factory=dict)


class DiffusionAdapter(ABC):
    """One model family. Instances are cheap; `load()` builds the modules."""

    name: str
    io_spec: IOSpec
    time_convention: TimeConvention
    tasks: Mapping[Task, tuple[MediaRole, ...]]    # task -> media roles it requires
    lora_map: LoRATargetMap
    schedule_shift: float = 1.0
    model_time_scale: float = 1000.0               # model time = scale * (sigma or 1 - sigma)
    sampling_defaults: Mapping[str, int] = {}      # e.g. {"height": 32, "width": 32, "num_frames": 1}

    # ---- request checks (the ingress and the rollout strategy share these) --------------
    def validate_request(self, request: RolloutRequest,
                         limits: RequestLimits) -> dict[MediaRole, torch.Tensor]:
        """Contract checks of `request` against this adapter (limits, task, exactly the task's
        media roles, sizes it can generate); returns the canonical condition media."""
        rid = request.request_id
        check_limits(request, limits)
        if request.task not in self.tasks:
            raise InvalidRequestError(f"adapter {self.name} does not serve this task",
                                      field="task", expected=[t.value for t in self.tasks],
                                      actual=request.task.value, request_id=rid)
        media = normalize_media(request.media, request.task, rid)
        required = set(self.tasks[request.task])
        missing, extra = required - set(media), set(media) - required
        if missing or extra:
            raise InvalidRequestError(f"task {request.task.value} takes exactly the media roles "
                                      f"{sorted(r.value for r in required)}", field="media",
                                      expected=sorted(r.value for r in required),
                                      actual=sorted(r.value for r in media), request_id=rid)
        self.state_shape(request.sampling)                   # adapter-specific size checks
        return {role: item.data for role, item in media.items()}

    # ---- components -------------------------------------------------------------------
    @abstractmethod
    def load(self, path: str | None = None) -> Components:
        """Load weights from `path` (a local directory) or the weights shipped in the repo."""

    @abstractmethod
    def to_inference_form(self, transformer: nn.Module) -> nn.Module:
        """Convert a training-form transformer into the packed inference form (a new module)."""

    # ---- prompts ----------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, texts: Sequence[str]) -> list[PromptBundle]:
        """Token ids for each text with the encoder's own tokenizer (the only tokenization)."""

    def null_prompt(self) -> PromptBundle:
        """The unconditional prompt of classifier-free guidance: the encoder's empty prompt."""
        return self.tokenize([""])[0]

    @abstractmethod
    def encode(self, text_encoder: nn.Module, prompts: Sequence[PromptBundle]) -> TextCondition:
        """Run the text encoder on the ids exactly as given."""

    # ---- sampler state ----------------------------------------------------------------
    @abstractmethod
    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        """Per-row sampler state shape S (the packed latent the sampler steps on)."""

    @abstractmethod
    def model_forward(self, transformer: nn.Module, state: torch.Tensor,
                      model_time: torch.Tensor, cond: TextCondition,
                      media: Mapping[MediaRole, torch.Tensor] | None = None) -> torch.Tensor:
        """Raw model output in the model's own time convention. state: (B, *S); model_time: (B,)."""

    @abstractmethod
    def split_state(self, state: torch.Tensor, sampling: SamplingSpec) -> dict[str, torch.Tensor]:
        """Sampler state (B, *S) -> named latent artifacts (model-native layout)."""

    @abstractmethod
    def decode(self, decoders: Mapping[str, nn.Module], latent_name: str,
               latent: torch.Tensor) -> torch.Tensor:
        """Decode one latent artifact to its decoded form (uint8 pixels / float waveform)."""

    # ---- conditioning media (tasks with first/last frames etc.) --------------------------
    def encode_media(self, components: Components, sampling: SamplingSpec,
                     media: Mapping[MediaRole, torch.Tensor]) -> dict[MediaRole, torch.Tensor]:
        """Decoded condition media -> condition latents. Adapters without conditions have none."""
        if media:
            raise NotImplementedError(f"{self.name} takes no media conditions")
        return {}

    def apply_conditions(self, state: torch.Tensor,
                         cond_latents: Mapping[MediaRole, torch.Tensor]) -> torch.Tensor:
        """Write frozen condition latents into the state (in-context conditioning). Default: none."""
        return state
