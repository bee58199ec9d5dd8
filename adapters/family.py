"""The model seam: one `ModelFamily` per family, with its parts cut by job.

    family = get_family("sd3", "/ckpt/sd3.5-medium")       # adapters/registry.py (or "auto")
    family.spec           declarations: io spec, tasks, time convention, guidance rule (its
                          pipeline's: which scales run CFG), encoders (+ ETP plan), transformer
                          components, LoRA targets, decoders, defaults
    family.load(name)     one checkpoint component, in a dtype on a device (each stage loads
                          only the components it uses)
    family.sigmas(s)      the sigma table of a sampling spec (incl. resolution-dependent shift)
    family.conditioner    tokenize (the checkpoint's own tokenizers -> PromptBundle with ids per
                          encoder), null prompt, encode(encoders, prompts) -> contract.Condition
    family.denoiser       stateless forward (diffusion.step.Denoiser)
    family.codec          state <-> named latents, condition media -> MediaCondition, decode

The one denoising step (forward + guidance + time convention + sampler) is
`diffusion.step.denoise_step`; nothing in a family re-implements it. What every diffusers-
checkpoint family shares (its entry's pipeline class and options, the pipeline's scheduler, the
[-1, 1] -> uint8 postprocess, the condition-frame, edit source-image and decoded-latent checks,
a request's id on its errors) is here too: `CheckpointFamily` and the helpers below.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from adapters.checkpoint import load_component, read_model_index, resolve_dtype
from adapters.families import family_entry
from contract import (ArtifactSpec, Condition, ConfigError, InvalidRequestError, IOSpec, Layout,
                      LimitExceededError, MediaFormatError, MediaRole, Modality, PromptBundle,
                      Representation, RequestLimits, RolloutRequest, SamplingSpec, Task,
                      TimeConvention, check_limits, normalize_media)
from diffusion.guidance import GuidanceRule
from diffusion.step import FrozenLatents, applied_guidance_scale, doubles_rows
from diffusion.windows import check_flash, flash_sigmas


def parse_options(cls: type[BaseModel], options: Mapping | None, family: str) -> BaseModel:
    """A family's options (config `rollout.adapter_options`: a mapping, or already the model)
    or ConfigError naming the field."""
    if isinstance(options, cls):
        return options
    try:
        return cls.model_validate(dict(options or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid {family} options: {first['msg']}",
                          field=f"rollout.adapter_options.{loc}",
                          actual=first.get("input")) from None


class NoOptions(BaseModel):
    """A family without options: any option given is an error naming it."""

    model_config = {"extra": "forbid", "frozen": True}


FRAME_ROLES = (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME)   # media that are one video frame


@contextmanager
def request_errors(request_id: str | None) -> Iterator[None]:
    """Request errors raised inside carry `request_id` (unless they name one already)."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.request_id is None:
            exc.request_id = request_id
        raise


def unit_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels in [-1, 1] -> uint8, as diffusers' VaeImageProcessor / VideoProcessor
    postprocess them: (x / 2 + 0.5) clamped to [0, 1], * 255, rounded."""
    return ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def check_condition_frame(frame: torch.Tensor, height: int, width: int, field: str) -> None:
    """A condition frame must be uint8 (3, H, W) at the request's size: nothing is resized."""
    if frame.dtype != torch.uint8 or tuple(frame.shape) != (3, height, width):
        raise MediaFormatError("a condition frame must be uint8 (3, H, W) at the request's "
                               "height and width (nothing is resized)", field=field,
                               expected=f"uint8 (3, {height}, {width})",
                               actual=f"{frame.dtype} {tuple(frame.shape)}")


def check_source_image(image: torch.Tensor, limits: RequestLimits,
                       field: str = "media.image") -> None:
    """An edit's source image is within the request's size bounds (never resized to fit)."""
    for axis, name, bound in ((1, "height", limits.max_height), (2, "width", limits.max_width)):
        if image.ndim == 3 and image.shape[axis] > bound:
            raise LimitExceededError(f"the source image's {name} exceeds the request bound",
                                     field=field, expected=f"{name} <= {bound}",
                                     actual=tuple(image.shape))


def check_latent_shape(latent: torch.Tensor, want: Sequence[int], latent_name: str) -> None:
    """A latent handed to a decoder has the per-row shape its sampling size gives."""
    if tuple(latent.shape[1:]) != tuple(want):
        raise InvalidRequestError("the latent does not match the sampling size",
                                  field=f"artifacts.{latent_name}", expected=tuple(want),
                                  actual=tuple(latent.shape[1:]))


def image_io_spec(layout: Layout) -> IOSpec:
    """A text-to-image family's artifacts: its latent (in `layout`) and the decoded image."""
    return IOSpec(artifacts=(
        ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT, layout),
        ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                     source="image_latent")), defaults=("image_latent", "image"))


class Overflow(str, Enum):
    """What an encoder does with a prompt longer than its window (declared, never silent)."""

    REJECT = "reject"          # LimitExceededError naming the prompt and the encoder
    TRUNCATE = "truncate"      # cut to max_length as the family's pipeline does; recorded


@dataclass(frozen=True)
class ETPPlan:
    """How one text encoder splits over ETP shard workers (Megatron column / row parallel).

    layers: dotted path of the layer list; column / row: module names inside each layer;
    vocab: the token-embedding module (vocab-parallel) or None; heads: config attribute holding
    the attention head count (etp must divide it); local_heads: per-layer attributes that store
    a head count the attention code reshapes with (divided by etp on each shard).
    """

    layers: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    vocab: str | None
    heads: str = "num_attention_heads"
    local_heads: tuple[str, ...] = ()


@dataclass(frozen=True)
class EncoderSpec:
    """One text encoder: `name` keys its ids in a PromptBundle (the first encoder's ids are
    PromptBundle.token_ids); `component` / `tokenizer` are checkpoint subfolders;
    `extra_components` run with it in the encoder stage (LTX-2's text connectors)."""

    name: str
    component: str
    tokenizer: str
    max_length: int
    overflow: Overflow = Overflow.REJECT
    etp: ETPPlan | None = None
    vocab_size: int | None = None       # ids must lie in [0, vocab_size) (None: not checked)
    extra_components: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilySpec:
    """Everything a stage needs to know about a family before loading any weights."""

    name: str
    io_spec: IOSpec
    tasks: Mapping[Task, tuple[MediaRole, ...]]
    time_convention: TimeConvention
    model_time_scale: float
    guidance: GuidanceRule                           # kind + when its pipeline runs CFG
    transformers: tuple[str, ...]                    # denoiser components ("transformer", ...)
    lora_targets: Mapping[str, tuple[str, ...]]      # component -> module suffixes (explicit)
    encoders: tuple[EncoderSpec, ...]
    decoders: Mapping[str, tuple[str, ...]]          # latent artifact -> components it decodes with
    media_encoders: tuple[str, ...] = ()             # components that encode condition media
    # roles a task may take besides its required ones, in order (a multi-image edit's
    # image_2, image_3: a request takes a prefix of them)
    optional_media: Mapping[Task, tuple[MediaRole, ...]] = field(default_factory=dict)
    sampling_defaults: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.guidance, GuidanceRule):
            raise TypeError(f"{self.name}: FamilySpec.guidance is the family's GuidanceRule "
                            f"(diffusion.guidance: kind + when its pipeline runs CFG), not "
                            f"{self.guidance!r}")

    @property
    def encoder_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.encoders)

    def encoder(self, name: str) -> EncoderSpec:
        for e in self.encoders:
            if e.name == name:
                return e
        raise InvalidRequestError("the family has no encoder of this name", field="encoder",
                                  expected=list(self.encoder_names), actual=name)


@dataclass(frozen=True)
class MediaCondition:
    """Condition media of one request, encoded: entries held in the state (`frozen`) and named
    extra model inputs (`inputs`, (1 or B, ...) each, e.g. Wan I2V's image latents)."""

    frozen: FrozenLatents | None = None
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    key: tuple = ()        # what else rows must share to run together (e.g. the latent grid)
    state_shape: tuple[int, ...] | None = None   # the request's per-row state when its
    # conditions lengthen it (LTX-2's appended keyframe tokens); None = codec.state_shape

    def batch_key(self) -> tuple:
        return (None if self.frozen is None else tuple(self.frozen.mask.shape[1:]),
                tuple((k, tuple(v.shape[1:])) for k, v in sorted(self.inputs.items())),
                self.key)


NO_MEDIA = MediaCondition()


class Conditioner(ABC):
    """Prompts -> token ids (once) -> Condition. Ids are never decoded and re-tokenized.
    `media_roles`: condition media the text encoder itself reads (MiniMax-H3's keyframes, shown
    to its Qwen3-VL conditioner); the encoder stage gets them with the prompt."""

    media_roles: tuple[MediaRole, ...] = ()

    def __init__(self, spec: FamilySpec):
        self.spec = spec

    def encode_with_media(self, encoders: Mapping[str, nn.Module],
                          prompts: Sequence[PromptBundle],
                          media: Sequence[Mapping[MediaRole, torch.Tensor]]) -> Condition:
        """`encode` with each prompt's condition media of `media_roles` (one mapping per
        prompt); a conditioner that reads none refuses them."""
        raise InvalidRequestError("this family's text encoders read no condition media",
                                  field="media", expected=[],
                                  actual=sorted({r.value for m in media for r in m}))

    @abstractmethod
    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        """(ids, truncated) of `text` for one encoder with its own tokenizer; overflow handled
        as declared (REJECT raises LimitExceededError naming `field`; TRUNCATE cuts to the
        window as the family's pipeline does and says so)."""

    @abstractmethod
    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: Sequence[PromptBundle]) -> Condition:
        """Run the text encoders (name -> module) on the ids exactly as given: P rows."""

    def tokenize(self, texts: Sequence[str],
                 negatives: Sequence[str | None] | None = None) -> list[PromptBundle]:
        """One PromptBundle per text with ids for every encoder (and the negative prompt's)."""
        if negatives is not None and len(negatives) != len(texts):
            raise InvalidRequestError("one negative prompt (or null) per prompt",
                                      field="negative_prompts", expected=len(texts),
                                      actual=len(negatives))
        out = []
        for i, text in enumerate(texts):
            negative = None if negatives is None or negatives[i] is None else \
                self._bundle(negatives[i], f"negative_prompts[{i}]")
            out.append(self._bundle(text, f"prompts[{i}]", negative))
        return out

    def _bundle(self, text: str, field: str, negative: PromptBundle | None = None) -> PromptBundle:
        ids = {e.name: self.tokenize_one(e, text, field) for e in self.spec.encoders}
        first, *rest = self.spec.encoder_names
        return PromptBundle(token_ids=ids[first][0],
                            encoder_token_ids={name: ids[name][0] for name in rest},
                            truncated=tuple(name for name, (_, cut) in ids.items() if cut),
                            negative=negative, text=text)

    def null_prompt(self) -> PromptBundle:
        """The unconditional prompt of CFG when a request has no negative prompt: empty text."""
        return self._bundle("", "null_prompt")

    def unconditional(self, prompt: PromptBundle) -> PromptBundle:
        """The bundle the unconditional branch encodes: the prompt's negative, else the null."""
        return prompt.negative if prompt.negative is not None else self.null_prompt()

    def check_ids(self, prompt: PromptBundle, field: str = "prompt") -> dict[str, tuple[int, ...]]:
        """{encoder: ids}: ids for exactly the family's encoders, each within its window."""
        ids = prompt.ids_by_encoder(self.spec.encoder_names)
        for name, seq in ids.items():
            spec = self.spec.encoder(name)
            if len(seq) > spec.max_length:
                raise LimitExceededError("prompt ids are longer than the encoder window",
                                         field=f"{field}.{name}", expected=f"<= {spec.max_length}",
                                         actual=len(seq))
            if spec.vocab_size is not None and seq and not 0 <= min(seq) <= max(seq) < \
                    spec.vocab_size:
                raise InvalidRequestError("a token id is outside the encoder's vocabulary",
                                          field=f"{field}.{name}",
                                          expected=f"ids in [0, {spec.vocab_size})",
                                          actual=[i for i in seq if not 0 <= i < spec.vocab_size][:5])
        return ids


class Codec(ABC):
    """Latent state <-> named latent artifacts, condition media, decoding."""

    @abstractmethod
    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        """Per-row sampler state shape; a size the model cannot produce -> typed error."""

    @abstractmethod
    def split_state(self, state: torch.Tensor, sampling: SamplingSpec) -> dict[str, torch.Tensor]:
        """Sampler state (B, *S) -> named latent artifacts (model-native layout)."""

    @abstractmethod
    def join_state(self, latents: Mapping[str, torch.Tensor],
                   sampling: SamplingSpec) -> torch.Tensor:
        """Named latent artifacts -> the sampler state (the inverse of split_state)."""

    @abstractmethod
    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec) -> torch.Tensor:
        """Decode one latent artifact of a request sampled with `sampling` with its decoder
        components (uint8 pixels / float audio)."""

    def condition_state(self, state: torch.Tensor, sampling: SamplingSpec,
                        media: MediaCondition) -> torch.Tensor:
        """join_state's state (B, *state_shape(sampling)) -> the request's state (B,
        *media.state_shape) with the condition entries a condition appends (held values)."""
        if media.state_shape is not None:
            raise InvalidRequestError("this codec's conditions do not change the state shape",
                                      field="media.state_shape", expected=None,
                                      actual=media.state_shape)
        return state

    def encode_media(self, modules: Mapping[str, nn.Module], sampling: SamplingSpec,
                     media: Mapping[MediaRole, torch.Tensor]) -> MediaCondition:
        """Everything per request the forward needs besides the prompt: decoded condition
        media -> frozen state entries / model inputs, plus inputs fixed by the sampling size
        (FLUX's image position ids). Called for every request, with or without media;
        families without conditions take none."""
        if media:
            raise InvalidRequestError("this family takes no condition media", field="media",
                                      expected=[], actual=sorted(r.value for r in media))
        return NO_MEDIA


class OneLatentCodec(Codec):
    """A codec whose sampler state is its one latent artifact, as is (`latent_name`)."""

    latent_name: str                 # the artifact the state is, e.g. "image_latent"
    label: str                       # the family, in errors

    def split_state(self, state: torch.Tensor, sampling: SamplingSpec) -> dict[str, torch.Tensor]:
        return {self.latent_name: state}

    def join_state(self, latents: Mapping[str, torch.Tensor],
                   sampling: SamplingSpec) -> torch.Tensor:
        return latents[self.latent_name].float()

    def check_latent_name(self, latent_name: str) -> None:
        """`decode` is asked for this codec's one latent only."""
        if latent_name != self.latent_name:
            raise InvalidRequestError(f"{self.label} decodes {self.latent_name!r} only",
                                      field="latent_name", expected=self.latent_name,
                                      actual=latent_name)

    def check_latent(self, latent_name: str, latent: torch.Tensor,
                     sampling: SamplingSpec) -> None:
        """`decode` gets this codec's latent, at the shape `sampling` gives."""
        self.check_latent_name(latent_name)
        check_latent_shape(latent, self.state_shape(sampling), latent_name)


class ModelFamily(ABC):
    """One model family bound to one checkpoint folder. Construction reads JSON configs only."""

    spec: FamilySpec
    conditioner: Conditioner
    denoiser: "object"             # diffusion.step.Denoiser
    codec: Codec

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # ---- declarations ---------------------------------------------------------------------
    @abstractmethod
    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        """(num_steps + 1,) fp32 sigma table, 1 -> 0, as the family's pipeline schedules it."""

    def packed_form(self, component: str, transformer: nn.Module):
        """(packed copy, LoRATargetMap) of a transformer for an engine that serves fused q/k/v
        and sharded fc1 (adapters/inference_form.py), or ConfigError for a family without one."""
        raise ConfigError(f"{self.name} declares no packed inference form",
                          field="rollout.packed_inference_form", expected=False, actual=True)

    def request_sigmas(self, sampling: SamplingSpec, media: MediaCondition) -> torch.Tensor:
        """The sigma table of one request: `conditioned_sigmas`, compressed after the SDE
        window when the request asks for MixGRPO-Flash (diffusion.flash_sigmas)."""
        return flash_sigmas(self.conditioned_sigmas(sampling, media), sampling,
                            self.schedule_shift(sampling))

    def conditioned_sigmas(self, sampling: SamplingSpec, media: MediaCondition) -> torch.Tensor:
        """`sigmas(sampling)`, unless the request's conditions change the schedule (LTX-2's
        shift counts appended keyframe tokens)."""
        return self.sigmas(sampling)

    def pipeline_scheduler(self, sampling: SamplingSpec):
        """The checkpoint's own diffusers scheduler set to this sampling's table (what its
        pipeline steps with), or None for a family without one (the embedded tiny models)."""
        return None

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        """The static shift s (sigma' = s sigma / (1 + (s - 1) sigma)) the family's schedule
        applies at this sampling's size, for training-time noise levels (DPO's logit-normal
        table). A resolution-dependent exponential shift with mu is the static shift e^mu."""
        return 1.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def io_spec(self) -> IOSpec:
        return self.spec.io_spec

    # ---- components -----------------------------------------------------------------------
    def load(self, component: str, dtype: str | torch.dtype = torch.float32,
             device: str | torch.device = "cpu"):
        """One component (module, tokenizer or scheduler) from the checkpoint."""
        return load_component(self.root, component, resolve_dtype(dtype, device), device)

    def load_many(self, components: Sequence[str], dtype: str | torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> dict[str, nn.Module]:
        return {c: self.load(c, dtype, device) for c in components}

    def load_transformers(self, dtype=torch.float32, device="cpu") -> dict[str, nn.Module]:
        return self.load_many(self.spec.transformers, dtype, device)

    def load_encoders(self, dtype=torch.float32, device="cpu") -> dict[str, nn.Module]:
        """Text encoders keyed by encoder name (not component), as the conditioner reads them."""
        return {e.name: self.load(e.component, dtype, device) for e in self.spec.encoders}

    def load_decoder(self, latent_name: str, dtype=torch.float32,
                     device="cpu") -> dict[str, nn.Module]:
        if latent_name not in self.spec.decoders:
            raise InvalidRequestError("the family has no decoder for this latent",
                                      field="latent_name", expected=sorted(self.spec.decoders),
                                      actual=latent_name)
        return self.load_many(self.spec.decoders[latent_name], dtype, device)

    def load_media_encoders(self, dtype=torch.float32, device="cpu") -> dict[str, nn.Module]:
        return self.load_many(self.spec.media_encoders, dtype, device)

    def sampling_as_run(self, sampling: SamplingSpec) -> SamplingSpec:
        """`sampling` with the guidance scale its rows run at (1 where the family's rule runs
        the conditional branch alone): what the rollout records."""
        scale = applied_guidance_scale(self.spec.guidance, sampling.guidance_scale)
        if scale == sampling.guidance_scale:
            return sampling
        return sampling.model_copy(update={"guidance_scale": scale})

    # ---- request checks (the ingress and the rollout stage share these) ---------------------
    def validate_request(self, request: RolloutRequest,
                         limits: RequestLimits) -> dict[MediaRole, torch.Tensor]:
        """Every contract check of `request` against this family, before any work: limits,
        task, exactly the task's media roles, guidance, sizes it can generate, ids per
        encoder. Returns the canonical condition media."""
        rid = request.request_id
        check_limits(request, limits)
        if request.task not in self.spec.tasks:
            raise InvalidRequestError(f"{self.name} does not serve this task", field="task",
                                      expected=[t.value for t in self.spec.tasks],
                                      actual=request.task.value, request_id=rid)
        media = normalize_media(request.media, request.task, rid)
        required = set(self.spec.tasks[request.task])
        optional = tuple(self.spec.optional_media.get(request.task, ()))
        taken = [r for r in optional if r in media]
        if not required <= set(media) <= required | set(optional) or \
                taken != list(optional[:len(taken)]):
            expected = sorted(r.value for r in required)
            if optional:        # the required roles, then a prefix of the optional ones
                expected = {"required": expected, "then": [r.value for r in optional]}
            raise InvalidRequestError(f"task {request.task.value} takes exactly the media roles "
                                      f"{sorted(r.value for r in required)}" +
                                      (f" and a prefix of {[r.value for r in optional]}"
                                       if optional else ""), field="media",
                                      expected=expected,
                                      actual=sorted(r.value for r in media), request_id=rid)
        with request_errors(rid):
            doubles_rows(self.spec.guidance, request.sampling.guidance_scale)
            check_flash(request.sampling)
            self.codec.state_shape(request.sampling)
            self.conditioner.check_ids(request.prompt)
            if request.prompt.negative is not None:
                self.conditioner.check_ids(request.prompt.negative, "prompt.negative")
        return {role: item.data for role, item in media.items()}


class CheckpointFamily(ModelFamily):
    """A family read from a diffusers checkpoint folder, described by its entry in
    adapters/families.py (`entry_name`): the folder's model_index.json names a pipeline class
    the entry accepts, the options are the entry's options model, `schedule` (the checkpoint's
    own scheduler, adapters/diffusers_parts.FlowSchedule) gives the pipeline's scheduler, and
    condition frames are checked at the request's size before any work."""

    entry_name: str
    schedule: "object"              # adapters.diffusers_parts.FlowSchedule

    def __init__(self, root: str | Path, options: Mapping | BaseModel | None = None):
        super().__init__(root)
        self.entry = family_entry(self.entry_name)
        self.index = read_model_index(self.root)
        self.pipeline_class = self.entry.pipeline_class_of(self.index)
        self.options = parse_options(self.entry.options_model, options, self.entry.name)

    def pipeline_scheduler(self, sampling: SamplingSpec):
        return self.schedule.scheduler_at(self.sigmas(sampling))

    def validate_request(self, request: RolloutRequest,
                         limits: RequestLimits) -> dict[MediaRole, torch.Tensor]:
        media = super().validate_request(request, limits)
        with request_errors(request.request_id):
            for role in FRAME_ROLES:
                if role in media:
                    check_condition_frame(media[role], request.sampling.height,
                                          request.sampling.width, f"media.{role.value}")
        return media
