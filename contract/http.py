"""The JSON body of POST /rollout, parsed strictly and bounded before anything is allocated.

`parse_rollout_body(body, limits)` is the one entry point. In order: the body's bytes against
`max_body_bytes`; UTF-8; one JSON object with strict types (no string->bool/int coercion,
no NaN/Infinity, nesting bounded by the parser, no duplicated keys); then every size against the
graph's RequestLimits -- counts of prompts and artifacts, characters of each prompt, samples,
steps, height/width/frames, guidance, a branch rollout's factor, depth and fork steps
(contract.request.check_branch) -- each a typed error naming the field. A request for 10**9
samples is refused as a number, never expanded. Prompts are tokenized afterwards, once, at the
ingress, by the adapter's tokenizer.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, AsyncIterator, Sequence

from pydantic import ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo
from pydantic import field_validator, model_validator

from contract.enums import SOURCE_IMAGE_ROLES, SamplerKind, Task
from contract.errors import (FieldValidationError, InvalidRequestError, LimitExceededError,
                             MalformedBodyError)
from contract.request import (MAX_METADATA_CHARS, MAX_SEED, BranchSpec, FrozenModel,
                              RequestLimits, check_branch, resolve_window)
from contract.request import check_json_number as _check_json_number

MAX_NAME_CHARS = 128      # an artifact name or a policy version
MAX_METADATA_KEYS = 16    # entries of one prompt's metadata object
JSON_DEPTH_LIMIT = 200    # pydantic-core's JSON parser refuses deeper nesting (a valid body has 2)

# HTTP field -> the RequestLimits bound it is checked against (value <= bound)
_VALUE_BOUNDS = {"samples_per_prompt": "max_samples_per_prompt", "num_steps": "max_steps",
                 "height": "max_height", "width": "max_width", "num_frames": "max_frames",
                 "guidance_scale": "max_guidance_scale"}
_COUNT_BOUNDS = {"prompts": "max_prompts", "negative_prompts": "max_prompts",
                 "artifacts": "max_artifacts", "metadata": "max_prompts", "images": "max_prompts",
                 "media": "max_prompts"}
MAX_HTTP_REFERENCES = 16  # references one prompt's body may list (a family takes fewer: typed)
_MetaText = Annotated[str, StringConstraints(max_length=MAX_METADATA_CHARS)]
_MetaKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_METADATA_CHARS)]
PromptMetadata = dict[_MetaKey, _MetaText | int | float | bool]


class HTTPConditionMedia(FrozenModel):
    """One prompt's condition images by media role, each base64 of a PNG / JPEG / WebP file
    (decoded as `images` are): keyframes and ordered references."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    first_frame: str | None = Field(None, description="The first keyframe (i2va, fl2va).")
    last_frame: str | None = Field(None, description="The last keyframe (l2va, fl2va).")
    reference: tuple[str, ...] | None = Field(
        None, min_length=1, max_length=MAX_HTTP_REFERENCES,
        description="Ordered image references (ref2va); the order is part of the request.")

    @field_validator("reference", mode="before")
    @classmethod
    def _as_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value      # a JSON array

    def given(self) -> dict[str, str | tuple[str, ...]]:
        """role value -> what the body gave for it (roles left out are absent)."""
        return {k: v for k, v in (("first_frame", self.first_frame),
                                  ("last_frame", self.last_frame),
                                  ("reference", self.reference)) if v is not None}


class HTTPRolloutRequest(FrozenModel):
    """Validated from JSON only (`parse_rollout_body`): strict, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, protected_namespaces=())

    prompts: tuple[str, ...] = Field(min_length=1, description="One request (group) per prompt.")
    negative_prompts: tuple[str, ...] | None = Field(
        None, description="One negative prompt per prompt (CFG's unconditional branch); None = "
                          "the family's null prompt. An empty string is a negative prompt too.")
    samples_per_prompt: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="Row seeds are seed + row index (returned per sample).")
    num_steps: int = Field(10, ge=1)
    task: Task | None = Field(None, description="None = the adapter's first task.")
    sampler: SamplerKind = SamplerKind.SDE
    noise_level: float = Field(0.7, ge=0.0, le=2.0, allow_inf_nan=False)
    sde_window: tuple[int, int] | None = None
    guidance_scale: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    height: int | None = Field(None, ge=8)
    width: int | None = Field(None, ge=8)
    num_frames: int | None = Field(None, ge=1)
    artifacts: tuple[Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)],
                     ...] | None = Field(None, description="None = adapter defaults.")
    include_media: bool = Field(False, description="Return small decoded media as data URLs.")
    policy_version: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    metadata: tuple[PromptMetadata, ...] | None = Field(
        None, description="One flat object per prompt, passed to the scorers with it (e.g. "
                          "{\"ocr_text\": \"OPEN\"}); scalar values only, bounded in size.")
    images: tuple[str | tuple[str, ...], ...] | None = Field(
        None, description="One source image per prompt for a task that takes one (edit), or an "
                          "ordered list of 1 to 3 (a multi-image edit's sources, in order): "
                          "base64 of a PNG / JPEG / WebP file, 8-bit RGB, within max_width x "
                          "max_height; decoded at the ingress, never resized or converted.")
    media: tuple[HTTPConditionMedia, ...] | None = Field(
        None, description="One object per prompt of the condition images its task takes by "
                          "role ({\"first_frame\": b64, \"last_frame\": b64} for fl2va, "
                          "{\"reference\": [b64, ...]} for ref2va), each checked as `images` are.")
    branch: BranchSpec | None = Field(
        None, description="A branch (tree) rollout of every prompt: {\"fork_steps\": [steps], "
                          "\"factor\": children per fork}; each prompt returns samples_per_prompt "
                          "* factor ** len(fork_steps) samples, the tree's leaves, with the tree. "
                          "Bounded by max_branch_factor / max_branch_depth / "
                          "max_samples_per_prompt; fork steps inside the SDE window.")

    @model_validator(mode="before")
    @classmethod
    def _check_key_count(cls, value: Any) -> Any:
        """More keys than the model has fields is a mistake however they are named: refused
        before pydantic builds one error per unknown key (a 50k-key body costs seconds)."""
        if isinstance(value, dict) and len(value) > len(cls.model_fields):
            raise LimitExceededError("body has more keys than the request has fields",
                                     field="body", expected=f"<= {len(cls.model_fields)} keys",
                                     actual=len(value))
        return value

    # The bounds come from the validation context ({"limits": RequestLimits}) the ingress passes.
    @field_validator("prompts", "negative_prompts", "artifacts", "metadata", "images", "media",
                     mode="before")
    @classmethod
    def _check_count(cls, value: Any, info: ValidationInfo) -> Any:
        limits = _limits(info)
        if limits is not None and isinstance(value, (list, tuple)):
            bound = getattr(limits, _COUNT_BOUNDS[info.field_name])
            if len(value) > bound:
                raise LimitExceededError(f"too many {info.field_name}", field=info.field_name,
                                         expected=f"<= {bound}", actual=len(value))
        # a JSON array reaches this hook as a list; strict validation after it wants the tuple
        return tuple(value) if isinstance(value, list) else value

    @field_validator("images", mode="before")
    @classmethod
    def _check_image_lists(cls, value: Any) -> Any:
        """An entry of `images` is one image or an ordered list of 1..len(SOURCE_IMAGE_ROLES)
        images (the media roles an edit's sources take); any other length is refused by it."""
        if not isinstance(value, (list, tuple)):
            return value
        out = []
        for i, entry in enumerate(value):
            if isinstance(entry, (list, tuple)):
                if len(entry) > len(SOURCE_IMAGE_ROLES):
                    raise LimitExceededError("too many source images for one prompt",
                                             field=f"images[{i}]",
                                             expected=f"<= {len(SOURCE_IMAGE_ROLES)}",
                                             actual=len(entry))
                if not entry:
                    raise InvalidRequestError("a prompt's list of source images is empty",
                                              field=f"images[{i}]",
                                              expected=f"1..{len(SOURCE_IMAGE_ROLES)}",
                                              actual=0)
                entry = tuple(entry)
            out.append(entry)
        return tuple(out)

    @field_validator("prompts")
    @classmethod
    def _check_prompts(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        limits = _limits(info)
        for i, text in enumerate(value):
            if limits is not None and len(text) > limits.max_prompt_chars:
                raise LimitExceededError("prompt is too long (checked before tokenizing)",
                                         field=f"prompts[{i}]",
                                         expected=f"<= {limits.max_prompt_chars} characters",
                                         actual=len(text))
            if not text.strip():
                raise InvalidRequestError("prompt is empty or whitespace only",
                                          field=f"prompts[{i}]", expected="text",
                                          actual=text)
        return value

    @field_validator(*_VALUE_BOUNDS)
    @classmethod
    def _check_bound(cls, value: float | None, info: ValidationInfo) -> float | None:
        limits = _limits(info)
        if limits is not None and value is not None:
            bound = getattr(limits, _VALUE_BOUNDS[info.field_name])
            if value > bound:
                raise LimitExceededError(f"{info.field_name} is beyond the configured limit",
                                         field=info.field_name, expected=f"<= {bound}",
                                         actual=value)
        return value

    @field_validator("negative_prompts")
    @classmethod
    def _check_negatives(cls, value: tuple[str, ...] | None,
                         info: ValidationInfo) -> tuple[str, ...] | None:
        limits = _limits(info)
        for i, text in enumerate(value or ()):
            if limits is not None and len(text) > limits.max_prompt_chars:
                raise LimitExceededError("negative prompt is too long (checked before "
                                         "tokenizing)", field=f"negative_prompts[{i}]",
                                         expected=f"<= {limits.max_prompt_chars} characters",
                                         actual=len(text))
        return value

    @model_validator(mode="after")
    def _check_negative_count(self) -> "HTTPRolloutRequest":
        if self.negative_prompts is not None and len(self.negative_prompts) != len(self.prompts):
            raise InvalidRequestError("one negative prompt per prompt", field="negative_prompts",
                                      expected=len(self.prompts),
                                      actual=len(self.negative_prompts))
        return self

    @field_validator("sde_window", mode="before")
    @classmethod
    def _window_as_tuple(cls, value: Any) -> Any:
        """A JSON array reaches this hook as a list; strict validation wants the tuple (without
        this, every `sde_window` sent over HTTP was refused as "not a valid array")."""
        return tuple(value) if isinstance(value, list) else value

    @field_validator("metadata", mode="before")
    @classmethod
    def _check_metadata_size(cls, value: Any) -> Any:
        for i, entry in enumerate(value if isinstance(value, (list, tuple)) else ()):
            if isinstance(entry, dict) and len(entry) > MAX_METADATA_KEYS:
                raise LimitExceededError("prompt metadata has too many entries",
                                         field=f"metadata[{i}]",
                                         expected=f"<= {MAX_METADATA_KEYS}", actual=len(entry))
            for key, item in (entry.items() if isinstance(entry, dict) else ()):
                _check_json_number(item, f"metadata[{i}].{str(key)[:MAX_NAME_CHARS]}")
        return value

    @model_validator(mode="after")
    def _check_per_prompt_counts(self) -> "HTTPRolloutRequest":
        """metadata, images and media, when sent, hold one entry per prompt (checked in that
        order)."""
        for name, what in (("metadata", "one metadata object per prompt"),
                           ("images", "one image per prompt"),
                           ("media", "one condition-media object per prompt")):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.prompts):
                raise InvalidRequestError(what, field=name, expected=len(self.prompts),
                                          actual=len(values))
        return self

    @model_validator(mode="after")
    def _check_branch(self, info: ValidationInfo) -> "HTTPRolloutRequest":
        limits = _limits(info)
        if self.branch is not None and limits is not None:
            check_branch(self.branch, self.num_steps,
                         resolve_window(self.sampler, self.num_steps, self.sde_window),
                         self.samples_per_prompt, limits)
        return self

    @model_validator(mode="after")
    def _check_row_seeds(self) -> "HTTPRolloutRequest":
        last = self.seed + len(self.prompts) * self.samples_per_prompt - 1
        if last > MAX_SEED:
            raise InvalidRequestError("row seeds (seed + row index) must stay below 2**64",
                                      field="seed", expected=f"<= {MAX_SEED - (last - self.seed)}",
                                      actual=self.seed)
        return self


def _limits(info: ValidationInfo) -> RequestLimits | None:
    return (info.context or {}).get("limits")


async def read_bounded_body(declared: int | None, chunks: AsyncIterator[bytes],
                            bound: int) -> bytearray:
    """An HTTP body, refused by its declared Content-Length or as soon as it passes `bound`
    streaming in, so an oversized body is never held whole; one buffer, no joined copy."""
    if declared is not None and declared > bound:
        raise LimitExceededError("request body too large", field="body",
                                 expected=f"<= {bound} bytes", actual=declared)
    body = bytearray()
    async for chunk in chunks:
        if len(body) + len(chunk) > bound:
            raise LimitExceededError("request body too large", field="body",
                                     expected=f"<= {bound} bytes", actual=f"> {bound}")
        body += chunk
    return body


def parse_rollout_body(body: bytes | bytearray, limits: RequestLimits) -> HTTPRolloutRequest:
    """Bytes of a POST /rollout body -> HTTPRolloutRequest, or a typed error (4xx).

    A wrong type or value of a field is a FieldValidationError (422) naming it, from pydantic's
    first error (its list built once). Everything about the body as a whole is a
    MalformedBodyError (400) or, for its size or key count, a LimitExceededError (413).
    """
    if len(body) > limits.max_body_bytes:
        raise LimitExceededError("request body too large", field="body",
                                 expected=f"<= {limits.max_body_bytes} bytes", actual=len(body))
    if not body.isascii():            # the parser reads UTF-8 itself; this names the offset
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedBodyError("body is not UTF-8 text", field="body",
                                     expected="UTF-8 JSON",
                                     actual=f"invalid byte at offset {exc.start}") from None
    try:
        payload = HTTPRolloutRequest.model_validate_json(body, context={"limits": limits})
    except ValidationError as exc:
        first = first_error(exc)
        if first["type"] == "json_invalid":
            raise MalformedBodyError(f"body is not valid JSON: {first['msg']}", field="body",
                                     expected=f"UTF-8 JSON nested at most {JSON_DEPTH_LIMIT} "
                                              "deep") from None
        if first["type"] == "model_type":
            raise MalformedBodyError("body must be one JSON object", field="body",
                                     expected="object") from None
        raise FieldValidationError(first["msg"], field=error_field(first["loc"])) from None
    _reject_duplicate_keys(body)
    return payload


def first_error(exc: ValidationError) -> dict[str, Any]:
    """Pydantic's first error, its list built once and without copies of the input (the key and
    item caps above bound how long that list can be)."""
    return exc.errors(include_url=False, include_context=False, include_input=False)[0]


def error_field(loc: Sequence[Any]) -> str:
    """('prompts', 0) -> 'prompts[0]'."""
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + str(p)
                   for i, p in enumerate(loc))


def _reject_duplicate_keys(body: bytes | bytearray) -> None:
    """A key given twice is ambiguous (parsers disagree on which wins): refuse it. Runs on a body
    that already validated, so it is one flat object of bounded scalars and short arrays."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise MalformedBodyError("duplicated key in the JSON body", field=key,
                                         expected="each key once", actual=key)
            seen.add(key)
        return dict(items)
    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:   # pydantic parsed it first; kept typed anyway
        raise MalformedBodyError(f"body is not valid JSON: {exc}", field="body") from None
