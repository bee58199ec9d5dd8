"""The rollout request envelope (RFC 4.3): prompt tokens + media inputs + sampling spec.

JSON-shaped parts (PromptBundle, SamplingSpec, RequestLimits) are frozen pydantic models with
unknown fields forbidden; the envelope carries tensors, so it is a frozen dataclass.
Token ids travel from the dataset to the encoder unchanged: nothing here decodes or re-tokenizes.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationInfo,
                      field_validator)

from contract.enums import MediaRole, Modality, SamplerKind, Task
from contract.errors import (ConflictingInputError, DuplicateInputError, InvalidRequestError,
                             LimitExceededError, MediaFormatError, NonFiniteError,
                             UndeclaredArtifactError)

MAX_SEED = 2**64 - 1            # row seeds are 64-bit generator seeds (diffusion/noise.py)
MAX_REQUEST_ID_CHARS = 128
INT64 = (-2**63, 2**63 - 1)
MAX_METADATA_CHARS = 1024   # characters of one metadata key or string value
MAX_METADATA_ITEMS = 256    # keys and list entries of one request's metadata, nested included
MAX_METADATA_DEPTH = 4      # nesting of objects / lists (GenEval's record has 3)
# The smallest noise_level each stochastic sampler kind takes. A step's transition std is about
# noise_level * 1e-2 at the small steps of a 100-step schedule; below 1e-4 that is under float32's
# resolution of a unit-scale latent (the recorded sample stops carrying its noise), and far below
# it the std squares to 0 (no finite log-density). The rollout engine also checks the request's
# own schedule (diffusion.samplers.check_noise_representable).
MIN_NOISE_LEVEL = {SamplerKind.SDE: 1e-4, SamplerKind.DANCE_SDE: 1e-4, SamplerKind.CPS: 1e-4}


class FrozenModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class PromptBundle(FrozenModel):
    """Token ids of one prompt, exactly as the encoder's tokenizer produced them."""

    token_ids: tuple[int, ...] = Field(description="Ids for the family's first text encoder.")
    attention_mask: tuple[int, ...] | None = Field(None, description="1 = real token, 0 = pad.")
    encoder_token_ids: Mapping[str, tuple[int, ...]] = Field(
        default_factory=dict, description="Ids for the family's other named encoders (SD3: "
                                          "clip_g, t5), each from that encoder's tokenizer.")
    negative: "PromptBundle | None" = Field(
        None, description="The negative prompt, tokenized by the same tokenizers; None = no "
                          "negative prompt (the unconditional branch uses the family's null "
                          "prompt). A negative prompt of empty text is a bundle like any other.")
    truncated: tuple[str, ...] = Field(
        (), description="Encoders whose ids were cut to their window (an encoder declared to "
                        "truncate, as its pipeline does); recorded, never silent.")
    processor_kwargs: Mapping[str, Any] = Field(default_factory=dict,
                                                description="Forwarded to the model processor.")
    text: str | None = Field(None, description="The prompt text, for scorers and logging only.")

    def ids_by_encoder(self, encoders: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
        """{encoder: ids} for a family whose encoders are `encoders` (the first one's ids are
        `token_ids`). A missing or undeclared encoder is an error naming it."""
        first, *rest = encoders
        if set(self.encoder_token_ids) != set(rest):
            raise InvalidRequestError("the prompt's token ids do not cover exactly the family's "
                                      "encoders", field="prompt.encoder_token_ids",
                                      expected=list(rest), actual=sorted(self.encoder_token_ids))
        return {first: self.token_ids, **{name: self.encoder_token_ids[name] for name in rest}}

    # field validators (not a model validator) so a ValidationError's `loc` names the field
    @field_validator("token_ids")
    @classmethod
    def _check_token_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(value) == 0:
            raise ValueError("token_ids must not be empty")
        return _non_negative(value)

    @field_validator("encoder_token_ids")
    @classmethod
    def _check_encoder_ids(cls, value: Mapping[str, tuple[int, ...]]
                           ) -> Mapping[str, tuple[int, ...]]:
        for ids in value.values():
            _non_negative(ids)
        return value

    @field_validator("negative")
    @classmethod
    def _check_negative(cls, value: "PromptBundle | None") -> "PromptBundle | None":
        if value is not None and value.negative is not None:
            raise ValueError("a negative prompt has no negative prompt of its own")
        return value

    @field_validator("attention_mask")
    @classmethod
    def _check_mask(cls, value: tuple[int, ...] | None,
                    info: ValidationInfo) -> tuple[int, ...] | None:
        token_ids = info.data.get("token_ids")
        if value is not None and token_ids is not None and len(value) != len(token_ids):
            raise ValueError(f"attention_mask has {len(value)} entries, "
                             f"token_ids has {len(token_ids)}")
        return value


def _non_negative(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Token ids index an embedding table: a negative one is no token (the encoder would fail
    on it as a server error)."""
    bad = [i for i in ids if i < 0]
    if bad:
        raise ValueError(f"token ids must be >= 0, got {bad[:5]}")
    return ids


def resolve_window(sampler: SamplerKind, num_steps: int,
                   sde_window: tuple[int, int] | None) -> tuple[int, int]:
    """The SDE window [start, end) a request runs: (0, 0) for a deterministic sampler, the
    whole schedule minus the last step when none is given."""
    if sampler in (SamplerKind.ODE, SamplerKind.DPM2):     # deterministic kinds
        return (0, 0)
    if sde_window is None:
        return (0, max(num_steps - 1, 1))
    return tuple(sde_window)


class BranchSpec(FrozenModel):
    """A branch (tree) rollout: at each fork step every row alive splits into `factor` children
    that share its state and that step's forward, each child then drawing its own noise (its
    own seed, rollout.engine_api.child_seed). depth = len(fork_steps); a request of n seeds
    returns n * factor**depth rows, the tree's leaves (RolloutTree). Bounded by RequestLimits
    (max_branch_factor, max_branch_depth, max_samples_per_prompt: check_branch)."""

    fork_steps: tuple[StrictInt, ...] = Field(
        min_length=1, description="Steps at which every row forks, strictly increasing, each "
        "inside the schedule and before the SDE window's end (children differ only through "
        "stochastic steps after their fork).")
    factor: StrictInt = Field(2, ge=2, description="Children per row at each fork.")

    @property
    def depth(self) -> int:
        return len(self.fork_steps)

    def leaves(self, samples: int) -> int:
        """Rows a request of `samples` seeds returns."""
        return samples * self.factor ** self.depth

    @field_validator("fork_steps")
    @classmethod
    def _check_steps(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(step < 0 for step in value):
            raise ValueError(f"fork steps are >= 0, got {list(value)}")
        if any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError(f"fork steps must strictly increase, got {list(value)}")
        return value


class SamplingSpec(FrozenModel):
    """How to sample one request's rows. Every row has its own seed."""

    sampler: SamplerKind = SamplerKind.SDE
    num_steps: int = Field(10, ge=1)
    noise_level: float = Field(0.7, ge=0.0, le=2.0, description="SDE 'a' (FlowGRPO) / eta / CPS a.")
    sde_window: tuple[int, int] | None = Field(
        None, description="[start, end) steps that use the SDE; ODE outside. None = all steps "
                          "but the last.")
    guidance_scale: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    seeds: tuple[int, ...] = Field(description="One seed per row (len = samples_per_prompt), "
                                               "each in [0, 2**64).")
    height: int = Field(32, ge=8)
    width: int = Field(32, ge=8)
    num_frames: int = Field(1, ge=1)
    flash_compress: float | None = Field(
        None, gt=0.0, le=1.0, description="MixGRPO-Flash: after the SDE window, deterministic "
        "DPM-Solver++(2M) on a schedule compressed to this share of the remaining points "
        "(diffusion.flash_schedule, MixGRPO's dpm_post_compress_ratio); None = ODE outside "
        "the window.")

    @property
    def samples_per_prompt(self) -> int:
        return len(self.seeds)

    @property
    def window(self) -> tuple[int, int]:
        """Resolved SDE window [start, end): the whole schedule minus the last step by default."""
        return resolve_window(self.sampler, self.num_steps, self.sde_window)

    @field_validator("noise_level")
    @classmethod
    def _check_noise_level(cls, value: float, info: ValidationInfo) -> float:
        sampler = info.data.get("sampler")
        if value == 0.0 and sampler is not None and sampler not in (SamplerKind.ODE,
                                                                    SamplerKind.DPM2):
            raise ValueError(f"noise_level 0 leaves the {sampler.value} window without a "
                             "log-prob; use sampler='ode' for a deterministic rollout")
        least = MIN_NOISE_LEVEL.get(sampler, 0.0) if sampler is not None else 0.0
        if 0.0 < value < least:
            raise ValueError(f"noise_level {value!r} is below the {sampler.value} sampler's "
                             f"minimum {least} (float32 cannot carry its steps' noise)")
        return value

    @field_validator("seeds")
    @classmethod
    def _check_seeds(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(value) == 0:
            raise ValueError("seeds must hold one seed per row (got none)")
        bad = [s for s in value if not 0 <= s <= MAX_SEED]
        if bad:
            raise ValueError(f"a seed must be in [0, 2**64), got {bad[0]}")
        return value

    @field_validator("flash_compress")
    @classmethod
    def _check_flash(cls, value: float | None, info: ValidationInfo) -> float | None:
        sampler = info.data.get("sampler")
        if value is not None and sampler in (SamplerKind.ODE, SamplerKind.DPM2):
            raise ValueError(f"flash_compress follows an SDE window: the {sampler.value} "
                             "sampler has none")
        return value

    @field_validator("sde_window")
    @classmethod
    def _check_window(cls, value: tuple[int, int] | None,
                      info: ValidationInfo) -> tuple[int, int] | None:
        num_steps = info.data.get("num_steps")
        if value is not None and num_steps is not None:
            start, end = value
            if not 0 <= start < end <= num_steps:
                raise ValueError(f"sde_window {value} must satisfy 0 <= start < end <= "
                                 f"num_steps={num_steps}")
        return value


class RequestLimits(FrozenModel):
    """Bounds a request may ask for: one set per graph (GraphConfig.limits), read by the HTTP
    layer (contract/http.py, before any allocation), the ingress handle API and the rollout stage
    (check_limits)."""

    max_prompts: int = Field(16, ge=1, description="Prompts (requests) in one call.")
    max_samples_per_prompt: int = Field(32, ge=1, description="Rows (seeds) per prompt.")
    max_steps: int = Field(100, ge=1)
    max_height: int = Field(1024, ge=8)
    max_width: int = Field(1024, ge=8)
    max_frames: int = Field(129, ge=1)
    max_tokens: int = Field(512, ge=1, description="Token ids per encoder, per prompt.")
    max_prompt_chars: int = Field(4096, ge=1, description="Characters of one HTTP prompt, "
                                  "checked before it is tokenized.")
    max_artifacts: int = Field(16, ge=1, description="Names in requested_artifacts.")
    max_guidance_scale: float = Field(100.0, gt=0)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Bytes of one HTTP body.")
    max_branch_factor: int = Field(4, ge=2, description="Children per row at a fork of a "
                                   "branch rollout (BranchSpec.factor).")
    max_branch_depth: int = Field(3, ge=1, description="Forks of one branch rollout "
                                  "(len(BranchSpec.fork_steps)); its rows, samples * factor ** "
                                  "depth, are bounded by max_samples_per_prompt too.")


@dataclass(frozen=True)
class MediaInput:
    """A conditioning media tensor: decoded uint8 image CHW / video TCHW, or float audio CT.
    A task's ordered role (ORDERED_MEDIA: ref2va's references) takes one input per item in
    request order; normalize_media gives it as one canonical input whose data is the tuple."""

    modality: Modality
    role: MediaRole
    data: torch.Tensor | np.ndarray | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt, `samples_per_prompt` rows (a GRPO group), the artifacts wanted back."""

    prompt: PromptBundle
    sampling: SamplingSpec
    task: Task
    media: tuple[MediaInput, ...] | None = None
    requested_artifacts: tuple[str, ...] | None = None   # None = the adapter's defaults
    policy_version: str | None = None                    # None = the replica's latest
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    branch: BranchSpec | None = None                     # None = independent rows

    @property
    def output_rows(self) -> int:
        """Rows the request returns: its seeds, or a branch rollout's leaves."""
        n = self.sampling.samples_per_prompt
        return n if self.branch is None else self.branch.leaves(n)

    def __post_init__(self) -> None:
        """Field types, so a wrong one is a typed error here, not an AttributeError in a stage."""
        if not isinstance(self.request_id, str) or not 0 < len(self.request_id) <= \
                MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} "
                                      "characters", field="request_id",
                                      actual=type(self.request_id).__name__)
        rid = self.request_id
        checks = [("prompt", isinstance(self.prompt, PromptBundle), "PromptBundle"),
                  ("sampling", isinstance(self.sampling, SamplingSpec), "SamplingSpec"),
                  ("task", isinstance(self.task, Task), "Task"),
                  ("media", self.media is None or isinstance(self.media, (tuple, list)),
                   "tuple of MediaInput or None"),
                  ("requested_artifacts", self.requested_artifacts is None or (
                      isinstance(self.requested_artifacts, (tuple, list))
                      and all(isinstance(n, str) for n in self.requested_artifacts)),
                   "tuple of str or None"),
                  ("policy_version", self.policy_version is None
                   or isinstance(self.policy_version, str), "str or None"),
                  ("metadata", isinstance(self.metadata, Mapping), "a mapping"),
                  ("branch", self.branch is None or isinstance(self.branch, BranchSpec),
                   "BranchSpec or None")]
        for name, ok, expected in checks:
            if not ok:
                raise InvalidRequestError("wrong type", field=name, expected=expected,
                                          actual=type(getattr(self, name)).__name__,
                                          request_id=rid)
        check_metadata(self.metadata, request_id=rid)


def check_json_number(value: Any, field: str, request_id: str | None = None) -> None:
    """A JSON number as every peer reads it: finite (no NaN / Infinity, no 1e400 that parses to
    inf) and, for an integer, within 64 bits (a bigger one is rounded or refused by other
    parsers). As parsed, before any conversion could hide it."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise InvalidRequestError("integer outside 64 bits", field=field,
                                  expected="an integer in [-2**63, 2**63)",
                                  actual=f"{value.bit_length()}-bit integer", request_id=request_id)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequestError("number is not finite", field=field,
                                  expected="a finite number", actual=repr(value),
                                  request_id=request_id)


def check_metadata(metadata: Mapping[str, Any], field: str = "metadata",
                   request_id: str | None = None) -> None:
    """A request's metadata is JSON a peer can read back: objects with string keys, lists,
    strings, booleans, null and strict numbers (check_json_number), bounded in string length,
    item count and depth. The same rule for the handle API, HTTP and prompt files."""
    count = 0

    def walk(value: Any, where: str, depth: int) -> None:
        nonlocal count
        if isinstance(value, np.generic):         # a column read from parquet / numpy
            value = value.item()
        if isinstance(value, str):
            if len(value) > MAX_METADATA_CHARS:
                raise LimitExceededError("metadata string too long", field=where,
                                         expected=f"<= {MAX_METADATA_CHARS} characters",
                                         actual=len(value), request_id=request_id)
            return
        if value is None or isinstance(value, (bool, int, float)):
            check_json_number(value, where, request_id)
            return
        if isinstance(value, (Mapping, list, tuple)):
            if depth >= MAX_METADATA_DEPTH:
                raise LimitExceededError("metadata nested too deep", field=where,
                                         expected=f"<= {MAX_METADATA_DEPTH} levels",
                                         actual=depth + 1, request_id=request_id)
            count += len(value)
            if count > MAX_METADATA_ITEMS:
                raise LimitExceededError("metadata has too many entries", field=field,
                                         expected=f"<= {MAX_METADATA_ITEMS} keys and items",
                                         actual=f"> {MAX_METADATA_ITEMS}", request_id=request_id)
            if isinstance(value, Mapping):
                for key, item in value.items():
                    if not isinstance(key, str) or not 0 < len(key) <= MAX_METADATA_CHARS:
                        raise InvalidRequestError(
                            "metadata keys are strings of 1.."
                            f"{MAX_METADATA_CHARS} characters", field=where,
                            actual=repr(key)[:60], request_id=request_id)
                    walk(item, f"{where}.{key}", depth + 1)
            else:
                for i, item in enumerate(value):
                    walk(item, f"{where}[{i}]", depth + 1)
            return
        raise InvalidRequestError("metadata values are JSON: objects, lists, strings, numbers, "
                                  "booleans or null", field=where, actual=type(value).__name__,
                                  request_id=request_id)

    walk(metadata, field, 0)


_VIDEO_FRAME_ROLES = {MediaRole.IMAGE: MediaRole.FIRST_FRAME}  # alias -> canonical role
# tasks whose `image` condition is the first frame
_VIDEO_TASKS = (Task.FL2VA, Task.I2V, Task.I2VA)
# tasks whose inputs of one role are an ordered list (modality, role): the order is the request
ORDERED_MEDIA = {Task.REF2VA: (Modality.IMAGE, MediaRole.REFERENCE)}


def _as_tensor(data: torch.Tensor | np.ndarray, field_name: str, request_id: str) -> torch.Tensor:
    if not isinstance(data, np.ndarray):
        return data
    try:  # a copy only where needed (e.g. a flipped view with negative strides)
        return torch.from_numpy(np.ascontiguousarray(data))
    except TypeError:
        raise MediaFormatError("media array has a dtype torch cannot hold", field=field_name,
                               actual=str(data.dtype), request_id=request_id) from None


def normalize_media(media: tuple[MediaInput, ...] | None, task: Task,
                    request_id: str) -> dict[MediaRole, MediaInput]:
    """Canonical role -> input. Rejects duplicates and conflicting aliases (RFC 4.3). A task's
    ordered role (ORDERED_MEDIA) collects its inputs in request order into one input whose data
    is the tuple of tensors."""
    if media is None:
        return {}
    by_key: dict[tuple[Modality, MediaRole], int] = {}
    canonical: dict[MediaRole, tuple[int, MediaInput]] = {}
    ordered_modality, ordered_role = ORDERED_MEDIA.get(task, (None, None))
    ordered: list[torch.Tensor] = []
    for i, item in enumerate(media):
        if not isinstance(item, MediaInput):
            raise InvalidRequestError("media entries must be MediaInput", field=f"media[{i}]",
                                      actual=type(item).__name__, request_id=request_id)
        if item.role is ordered_role:
            if item.modality is not ordered_modality:
                raise MediaFormatError(f"task {task.value} takes {ordered_role.value} inputs of "
                                       f"modality {ordered_modality.value}",
                                       field=f"media[{i}].modality",
                                       expected=ordered_modality.value,
                                       actual=getattr(item.modality, "value", item.modality),
                                       request_id=request_id)
            tensor = _as_tensor(item.data, f"media[{i}].data", request_id)
            _check_media_tensor(tensor, item.modality, f"media[{i}].data", request_id)
            ordered.append(tensor)
            canonical.setdefault(ordered_role, (i, item))
            continue
        key = (item.modality, item.role)
        if key in by_key:
            raise DuplicateInputError(
                "two media inputs share modality and role", field=f"media[{i}]",
                expected="unique (modality, role)", actual=f"{item.modality.value}/"
                f"{item.role.value} also at media[{by_key[key]}]", request_id=request_id)
        by_key[key] = i
        role = _VIDEO_FRAME_ROLES.get(item.role, item.role) if task in _VIDEO_TASKS else item.role
        tensor = _as_tensor(item.data, f"media[{i}].data", request_id)
        _check_media_tensor(tensor, item.modality, f"media[{i}].data", request_id)
        normalized = MediaInput(item.modality, role, tensor)
        if role in canonical:
            j, other = canonical[role]
            if other.data.shape != tensor.shape or not torch.equal(other.data, tensor):
                raise ConflictingInputError(
                    f"media[{i}] ({item.role.value}) and media[{j}] are aliases of {role.value} "
                    "but differ (exact shape and value equality is required)",
                    field=f"media[{i}].data", expected=tuple(other.data.shape),
                    actual=tuple(tensor.shape), request_id=request_id)
            continue
        canonical[role] = (i, normalized)
    if ordered:
        canonical[ordered_role] = (canonical[ordered_role][0],
                                   MediaInput(ordered_modality, ordered_role, tuple(ordered)))
    return {role: item for role, (_, item) in canonical.items()}


def _check_media_tensor(data: torch.Tensor, modality: Modality, field_name: str,
                        request_id: str) -> None:
    if not isinstance(data, torch.Tensor):
        raise MediaFormatError("media data must be a tensor or array", field=field_name,
                               actual=type(data).__name__, request_id=request_id)
    want_ndim = {Modality.IMAGE: 3, Modality.VIDEO: 4, Modality.AUDIO: 2}[modality]
    if data.ndim != want_ndim:
        raise MediaFormatError(f"{modality.value} input must have {want_ndim} dims",
                               field=field_name, expected=want_ndim, actual=data.ndim,
                               request_id=request_id)
    if modality == Modality.AUDIO:
        if not data.is_floating_point():
            raise MediaFormatError("audio input must be a float waveform", field=field_name,
                                   expected="float", actual=str(data.dtype), request_id=request_id)
        if not bool(torch.isfinite(data).all()):
            raise NonFiniteError("audio input holds NaN/Inf", field=field_name,
                                 request_id=request_id)
    elif data.dtype != torch.uint8:
        raise MediaFormatError(f"{modality.value} input must be uint8 pixels in [0, 255]",
                               field=field_name, expected="torch.uint8", actual=str(data.dtype),
                               request_id=request_id)


def check_limits(request: RolloutRequest, limits: RequestLimits) -> None:
    """Fail closed on every size the request asks for."""
    s, rid = request.sampling, request.request_id
    checks = [
        ("sampling.seeds", len(s.seeds), limits.max_samples_per_prompt),
        ("sampling.num_steps", s.num_steps, limits.max_steps),
        ("sampling.height", s.height, limits.max_height),
        ("sampling.width", s.width, limits.max_width),
        ("sampling.num_frames", s.num_frames, limits.max_frames),
        ("sampling.guidance_scale", s.guidance_scale, limits.max_guidance_scale),
        ("requested_artifacts", len(request.requested_artifacts or ()), limits.max_artifacts),
        ("prompt.token_ids", len(request.prompt.token_ids), limits.max_tokens),
    ]
    for name, ids in request.prompt.encoder_token_ids.items():
        checks.append((f"prompt.encoder_token_ids.{name}", len(ids), limits.max_tokens))
    negative = request.prompt.negative
    if negative is not None:
        checks.append(("prompt.negative.token_ids", len(negative.token_ids), limits.max_tokens))
        for name, ids in negative.encoder_token_ids.items():
            checks.append((f"prompt.negative.encoder_token_ids.{name}", len(ids),
                           limits.max_tokens))
    for name, value, bound in checks:
        if value > bound:
            raise LimitExceededError(f"{name} is beyond the configured limit", field=name,
                                     expected=f"<= {bound}", actual=value, request_id=rid)
    if request.branch is not None:
        check_branch(request.branch, s.num_steps, s.window, len(s.seeds), limits, rid)


def check_branch(branch: BranchSpec, num_steps: int, window: tuple[int, int], samples: int,
                 limits: RequestLimits, request_id: str | None = None) -> None:
    """A branch rollout against the graph's limits and its request's schedule, before any
    work: factor and depth within their bounds, its rows (samples * factor ** depth) within
    max_samples_per_prompt, every fork step inside the schedule and before the SDE window's
    end (`window`, resolved: (0, 0) for a deterministic sampler -- no fork can branch it)."""
    rid = request_id
    if branch.factor > limits.max_branch_factor:
        raise LimitExceededError("branch.factor is beyond the configured limit",
                                 field="branch.factor", expected=f"<= {limits.max_branch_factor}",
                                 actual=branch.factor, request_id=rid)
    if branch.depth > limits.max_branch_depth:
        raise LimitExceededError("branch depth (fork steps) is beyond the configured limit",
                                 field="branch.fork_steps",
                                 expected=f"<= {limits.max_branch_depth} steps",
                                 actual=branch.depth, request_id=rid)
    rows = branch.leaves(samples)
    if rows > limits.max_samples_per_prompt:
        raise LimitExceededError("a branch rollout's rows (samples * factor ** depth) are "
                                 "beyond max_samples_per_prompt", field="branch",
                                 expected=f"<= {limits.max_samples_per_prompt} rows",
                                 actual=rows, request_id=rid)
    for i, step in enumerate(branch.fork_steps):
        if not step < num_steps:
            raise InvalidRequestError("a fork step is outside the schedule",
                                      field=f"branch.fork_steps[{i}]",
                                      expected=f"< num_steps={num_steps}", actual=step,
                                      request_id=rid)
        if not step < window[1]:
            raise InvalidRequestError("a fork step is at or after the SDE window's end: its "
                                      "children would take no stochastic step and be identical",
                                      field=f"branch.fork_steps[{i}]",
                                      expected=f"< {window[1]} (the window {tuple(window)})",
                                      actual=step, request_id=rid)


def check_requested_artifacts(request: RolloutRequest, declared: tuple[str, ...]) -> tuple[str, ...]:
    """Resolve the requested names against the adapter's declared ones."""
    names = request.requested_artifacts
    if names is None:
        return declared
    if len(names) == 0:
        raise InvalidRequestError("requested_artifacts is empty; pass None for the adapter's "
                                  "defaults", field="requested_artifacts", expected="non-empty "
                                  "or None", actual=[], request_id=request.request_id)
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise DuplicateInputError("artifact requested twice", field="requested_artifacts",
                                      actual=name, request_id=request.request_id)
        seen.add(name)
        if name not in declared:
            raise UndeclaredArtifactError("requested artifact is not declared by the adapter",
                                          field="requested_artifacts", expected=list(declared),
                                          actual=name, request_id=request.request_id)
    return tuple(names)
