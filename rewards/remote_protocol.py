"""The remote-scorer wire format: JSON only (never pickle), media as base64 PNG / WAV.

Request (POST, application/json):
    {"prompts": [str] * B,
     "metadata": [{str: JSON value}] * B,                       # per-sample prompt metadata
     "groups": [int],                  # optional: sizes of the consecutive prompt groups the B
                                       # samples form (sum B, each >= 1); absent / [] = not stated
     "media": {name: {"modality": "image", "format": "png", "items": [b64 PNG] * B}
                   | {"modality": "video", "format": "png", "fps": f, "items": [[b64 PNG] * T] * B}
                   | {"modality": "audio", "format": "wav", "sample_rate": r,
                      "items": [b64 WAV] * B}}}
Response (200, application/json):
    {"scores": {score name: [float | null] * B},
     "status": ["ok" | "failed"] * B,  "reasons": [str | null] * B,   # optional: all ok
     "metadata": {str: JSON value}}                                   # optional
A score is null exactly where its sample's status is "failed". Any other answer -- an error
status, a body that is not JSON, lengths or types that differ -- is a protocol error.

PNG keeps uint8 pixels exactly; WAV is written as 32-bit float, so audio round-trips exactly too.
Groups: a groupwise scorer (rewards/groupwise.py: PickScore_Rank, the pairwise judge) compares
the samples of a prompt group, so a client of one sends whole groups in one request with their
sizes; the server hands them to its scorer as ScoreRequest.groups (it refuses a batch whose
groups are not stated or split, as it does in process).
"""
from __future__ import annotations

import base64
import io
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from contract import (ArtifactSpec, InvalidRequestError, LimitExceededError, MediaArtifact,
                      MediaFormatError, Modality, ScorerOutput, ScoreStatus)

JSON_SCALARS = (str, int, float, bool, type(None))


def png_base64(image_chw: np.ndarray) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _wav(audio_ct: np.ndarray, sample_rate: int) -> str:
    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, np.ascontiguousarray(audio_ct.T), sample_rate, format="WAV",
                    subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_artifact(art: MediaArtifact) -> dict[str, Any]:
    """A decoded artifact (B, ...) -> its JSON media entry."""
    data = art.data.cpu().numpy()
    modality = art.spec.modality
    if modality == Modality.IMAGE:
        return {"modality": "image", "format": "png", "items": [png_base64(x) for x in data]}
    if modality == Modality.VIDEO:
        return {"modality": "video", "format": "png", "fps": float(art.fps),
                "items": [[png_base64(f) for f in clip] for clip in data]}
    return {"modality": "audio", "format": "wav", "sample_rate": int(art.sample_rate),
            "items": [_wav(x, int(art.sample_rate)) for x in data]}


def json_metadata(meta: Mapping[str, Any], keys: Sequence[str] | None) -> dict[str, Any]:
    """The JSON-typed entries of one sample's metadata (condition tensors are media, not sent),
    or exactly `keys` (each must be present and JSON-typed)."""
    if keys is None:
        return {k: v for k, v in meta.items() if _is_json(v)}
    out = {}
    for k in keys:
        if k not in meta or not _is_json(meta[k]):
            raise InvalidRequestError("metadata entry the remote scorer sends is missing or not "
                                      "JSON", field=f"metadata.{k}", expected="a JSON value",
                                      actual=type(meta.get(k)).__name__)
        out[k] = meta[k]
    return out


def _is_json(value: Any, depth: int = 0) -> bool:
    if depth > 8:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json(v, depth + 1) for k, v in value.items())
    return False


MEDIA_FORMATS = {Modality.IMAGE: "png", Modality.VIDEO: "png", Modality.AUDIO: "wav"}


def _key_cap(model: type[BaseModel], value: Any) -> Any:
    """More keys than the model has fields is refused before pydantic builds an error per key."""
    if isinstance(value, dict) and len(value) > len(model.model_fields):
        raise ValueError(f"{len(value)} keys, more than the {len(model.model_fields)} fields")
    return value


class MediaEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    modality: Modality
    format: str
    items: list[Any]
    fps: float | None = Field(None, gt=0, allow_inf_nan=False)
    sample_rate: int | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, value: Any) -> Any:
        return _key_cap(cls, value)

    @model_validator(mode="after")
    def _check_items(self) -> "MediaEntry":
        if self.format != MEDIA_FORMATS[self.modality]:
            raise ValueError(f"{self.modality.value} media are sent as "
                             f"{MEDIA_FORMATS[self.modality]}, not {self.format[:20]!r}")
        if self.modality == Modality.VIDEO and self.fps is None:
            raise ValueError("video media need their fps")
        if self.modality == Modality.AUDIO and self.sample_rate is None:
            raise ValueError("audio media need their sample_rate")
        for i, item in enumerate(self.items):
            if self.modality == Modality.VIDEO:
                if not (isinstance(item, list) and item and all(isinstance(f, str) for f in item)):
                    raise ValueError(f"items[{i}] must be a non-empty list of base64 PNG strings")
            elif not isinstance(item, str):
                raise ValueError(f"items[{i}] must be a base64 string")
        return self


class ScoreBody(BaseModel):
    """A request as a reward server validates it (unknown fields rejected)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str] = Field(min_length=1)
    metadata: list[dict[str, Any]] = Field(default_factory=list)
    media: dict[str, MediaEntry]
    groups: list[StrictInt] = Field(default_factory=list, description="Sizes of the consecutive "
                                    "prompt groups of the batch; [] = not stated.")

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, value: Any) -> Any:
        return _key_cap(cls, value)


class DecodeBudget:
    """What one body may decode to, whatever its items' sizes: pixels (images and video frames
    together) and audio samples (frames x channels), charged from each item's header before it
    is decoded."""

    def __init__(self, max_pixels: int, max_samples: int):
        self.pixels, self.samples = max_pixels, max_samples

    def charge_pixels(self, n: int, field: str) -> None:
        if n > self.pixels:
            raise LimitExceededError("the body's images decode to more pixels than the server "
                                     "takes per request", field=field,
                                     expected=f"<= {self.pixels} pixels left", actual=n)
        self.pixels -= n

    def charge_samples(self, n: int, field: str) -> None:
        if n > self.samples:
            raise LimitExceededError("the body's audio decodes to more samples than the server "
                                     "takes per request", field=field,
                                     expected=f"<= {self.samples} samples left", actual=n)
        self.samples -= n


def _b64(text: str, field: str, kind: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise MediaFormatError(f"not base64 {kind}: {e}", field=field) from None


def _decode_png(b64: str, field: str, max_pixels: int, budget: DecodeBudget) -> np.ndarray:
    from PIL import Image
    raw = _b64(b64, field, "PNG")
    try:
        im = Image.open(io.BytesIO(raw), formats=["PNG"])      # header only, PNG only
    except Exception as e:  # noqa: BLE001 -- any decode failure is the client's bad media
        raise MediaFormatError(f"not a PNG: {e}", field=field) from None
    with im:
        if im.mode != "RGB":           # what encode_artifact writes; nothing converted here
            raise MediaFormatError("PNG must be 8-bit RGB", field=field, expected="RGB",
                                   actual=im.mode)
        if im.width * im.height > max_pixels:
            raise LimitExceededError("image is larger than the server's bound", field=field,
                                     expected=f"<= {max_pixels} pixels",
                                     actual=im.width * im.height)
        budget.charge_pixels(im.width * im.height, field)
        try:
            arr = np.asarray(im)
        except Exception as e:  # noqa: BLE001
            raise MediaFormatError(f"PNG does not decode: {e}", field=field) from None
    return arr.transpose(2, 0, 1).copy()


def _decode_wav(b64: str, field: str, budget: DecodeBudget) -> np.ndarray:
    import soundfile
    raw = _b64(b64, field, "WAV")
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:                 # header only
            if f.format != "WAV":
                raise MediaFormatError("audio must be WAV", field=field, expected="WAV",
                                       actual=f.format)
            budget.charge_samples(f.frames * f.channels, field)
            wave = f.read(dtype="float32", always_2d=True)
    except (MediaFormatError, LimitExceededError):
        raise
    except Exception as e:  # noqa: BLE001
        raise MediaFormatError(f"not a WAV: {e}", field=field) from None
    return wave.T.copy()


def decode_body(body: ScoreBody, max_pixels: int = 1024 * 1024, max_body_pixels: int = 32 << 20,
                max_body_samples: int = 16 << 20) -> tuple[dict[str, MediaArtifact], int]:
    """Server side: media entries -> decoded artifacts (B, ...); typed errors name the field.
    `max_pixels` bounds one image; `max_body_pixels` / `max_body_samples` everything the body
    decodes to (each item charged from its header before it is decoded)."""
    batch = len(body.prompts)
    if body.metadata and len(body.metadata) != batch:
        raise InvalidRequestError("one metadata object per prompt", field="metadata",
                                  expected=batch, actual=len(body.metadata))
    check_groups(body.groups, batch)
    budget = DecodeBudget(max_body_pixels, max_body_samples)
    out = {}
    for name, entry in body.media.items():
        field = f"media.{name}"
        if len(entry.items) != batch:
            raise InvalidRequestError("one media item per prompt", field=f"{field}.items",
                                      expected=batch, actual=len(entry.items))
        try:
            if entry.modality == Modality.AUDIO:
                data = torch.from_numpy(np.stack([_decode_wav(x, f"{field}.items[{i}]", budget)
                                                  for i, x in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.AUDIO, "decoded", "CT", source="remote",
                                    sample_rate=entry.sample_rate)
            elif entry.modality == Modality.IMAGE:
                data = torch.from_numpy(np.stack([
                    _decode_png(x, f"{field}.items[{i}]", max_pixels, budget)
                    for i, x in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.IMAGE, "decoded", "CHW", source="remote")
            else:
                data = torch.from_numpy(np.stack([np.stack([
                    _decode_png(f, f"{field}.items[{i}][{j}]", max_pixels, budget)
                    for j, f in enumerate(clip)]) for i, clip in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.VIDEO, "decoded", "TCHW", source="remote",
                                    fps=entry.fps)
        except ValueError as e:                 # np.stack of differing shapes
            raise MediaFormatError(f"items differ in shape: {e}", field=field) from None
        out[name] = MediaArtifact(spec, data)
    return out, batch


def check_groups(groups: Sequence[int], batch: int) -> None:
    """Stated groups are positive sizes covering the batch exactly (server side, before any
    decode); a groupwise scorer then checks its own needs (whole groups of >= 2)."""
    if not groups:
        return
    small = [i for i, n in enumerate(groups) if n < 1]
    if small:
        raise InvalidRequestError("a group holds at least one sample",
                                  field=f"groups[{small[0]}]", expected=">= 1",
                                  actual=groups[small[0]])
    if sum(groups) != batch:
        raise InvalidRequestError("the groups do not cover the batch", field="groups",
                                  expected=f"sizes summing to {batch}", actual=list(groups))


def output_json(out: ScorerOutput) -> dict[str, Any]:
    """Server side: a ScorerOutput -> the response body."""
    return {"scores": {k: list(v) for k, v in out.scores.items()},
            "status": ["ok" if s == ScoreStatus.OK else "failed" for s in out.status],
            "reasons": list(out.reasons), "metadata": dict(out.metadata)}


MAX_ANSWER_METADATA_BYTES = 4096   # an answer's metadata, as compact JSON
MAX_ANSWER_METADATA_DEPTH = 4      # {"a": {"b": [1]}} is 3 deep
MAX_REASON_CHARS = 1024


def _check_answer_metadata(metadata: Mapping[str, Any]) -> None:
    depth, stack = 0, [(metadata, 1)]
    while stack:                               # depth first, before serializing anything
        item, level = stack.pop()
        depth = max(depth, level)
        if depth > MAX_ANSWER_METADATA_DEPTH:
            raise ValueError(f"answer metadata is nested deeper than {MAX_ANSWER_METADATA_DEPTH}")
        children = item.values() if isinstance(item, Mapping) else \
            item if isinstance(item, (list, tuple)) else ()
        stack.extend((v, level + 1) for v in children if isinstance(v, (Mapping, list, tuple)))
    try:
        size = len(json.dumps(metadata, allow_nan=False, ensure_ascii=False,
                              separators=(",", ":")).encode("utf-8"))
    except (ValueError, TypeError) as e:      # NaN / inf, a lone surrogate, a non-JSON value
        raise ValueError(f"answer metadata is not finite, valid JSON: {e}") from None
    if size > MAX_ANSWER_METADATA_BYTES:
        raise ValueError(f"answer metadata has {size} bytes as JSON, more than "
                         f"{MAX_ANSWER_METADATA_BYTES}")


def _utf8(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} holds a lone surrogate at {e.start}") from None


class ScoreAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    scores: dict[str, list[float | None]]
    status: list[str] | None = None
    reasons: list[str | None] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


def parse_answer(payload: Any, scorer: str, batch: int) -> ScorerOutput:
    """Client side: a decoded JSON answer -> ScorerOutput; ValueError names what is wrong. Its
    `metadata` (copied into every sample the graph answers over HTTP) is bounded in bytes and
    depth and holds finite numbers and valid text only; each reason is bounded in characters."""
    try:
        ans = ScoreAnswer.model_validate(payload)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
        raise ValueError(f"answer breaks the protocol at {'.'.join(map(str, first['loc']))}: "
                         f"{first['msg']}") from None
    _check_answer_metadata(ans.metadata)
    for i, reason in enumerate(ans.reasons or ()):
        if reason is not None and len(reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason of sample {i} has {len(reason)} characters, more than "
                             f"{MAX_REASON_CHARS}")
        if reason is not None:
            _utf8(reason, f"reasons[{i}]")
    status = ans.status or ["ok"] * batch
    reasons = ans.reasons or [None] * batch
    if len(status) != batch or len(reasons) != batch:
        raise ValueError(f"status / reasons for {len(status)} / {len(reasons)} of {batch} samples")
    if any(s not in ("ok", "failed") for s in status):
        raise ValueError(f"status values must be 'ok' or 'failed', got {sorted(set(status))}")
    if not ans.scores:
        raise ValueError("answer has no scores")
    for key, vals in ans.scores.items():
        if len(vals) != batch:
            raise ValueError(f"score {key!r} has {len(vals)} values for {batch} samples")
        for i, (v, s) in enumerate(zip(vals, status)):
            if (s == "ok") != (v is not None and math.isfinite(v)):
                raise ValueError(f"score {key!r} of sample {i} is {v} with status {s!r}")
    return ScorerOutput(scorer=scorer, scores={k: tuple(v) for k, v in ans.scores.items()},
                        status=tuple(ScoreStatus.OK if s == "ok" else ScoreStatus.FAILED
                                     for s in status),
                        reasons=tuple(None if s == "ok" else (r or "the server reported a failure")
                                      for r, s in zip(reasons, status)),
                        metadata=ans.metadata)
