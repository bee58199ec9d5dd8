"""The remote-scorer wire format: JSON only (never pickle), media as base64 PNG / WAV.

Request (POST, application/json):
    {"prompts": [str] * B,
     "metadata": [{str: JSON value}] * B,                       # per-sample prompt metadata
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
"""
from __future__ import annotations

import base64
import io
import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class MediaEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    modality: Modality
    format: str
    items: list[Any]
    fps: float | None = Field(None, gt=0)
    sample_rate: int | None = Field(None, gt=0)


class ScoreBody(BaseModel):
    """A request as a reward server validates it (unknown fields rejected)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str]
    metadata: list[dict[str, Any]] = Field(default_factory=list)
    media: dict[str, MediaEntry]


def _decode_png(b64: str, field: str, max_pixels: int) -> np.ndarray:
    from PIL import Image
    try:
        raw = base64.b64decode(b64, validate=True)
        with Image.open(io.BytesIO(raw)) as im:
            if im.format != "PNG":
                raise ValueError(f"format {im.format}")
            if im.width * im.height > max_pixels:
                raise LimitExceededError("image is larger than the server's bound", field=field,
                                         expected=f"<= {max_pixels} pixels",
                                         actual=im.width * im.height)
            arr = np.asarray(im.convert("RGB"))
    except LimitExceededError:
        raise
    except Exception as e:  # noqa: BLE001 -- any decode failure is the client's bad media
        raise MediaFormatError(f"not a base64 PNG: {e}", field=field) from None
    return arr.transpose(2, 0, 1).copy()


def _decode_wav(b64: str, field: str) -> np.ndarray:
    import soundfile
    try:
        wave, _ = soundfile.read(io.BytesIO(base64.b64decode(b64, validate=True)),
                                 dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        raise MediaFormatError(f"not a base64 WAV: {e}", field=field) from None
    return wave.T.copy()


def decode_body(body: ScoreBody, max_pixels: int = 1024 * 1024) -> tuple[dict[str, MediaArtifact],
                                                                         int]:
    """Server side: media entries -> decoded artifacts (B, ...); typed errors name the field."""
    batch = len(body.prompts)
    if body.metadata and len(body.metadata) != batch:
        raise InvalidRequestError("one metadata object per prompt", field="metadata",
                                  expected=batch, actual=len(body.metadata))
    out = {}
    for name, entry in body.media.items():
        field = f"media.{name}"
        if len(entry.items) != batch:
            raise InvalidRequestError("one media item per prompt", field=f"{field}.items",
                                      expected=batch, actual=len(entry.items))
        try:
            if entry.modality == Modality.AUDIO:
                data = torch.from_numpy(np.stack([_decode_wav(x, f"{field}.items[{i}]")
                                                  for i, x in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.AUDIO, "decoded", "CT", source="remote",
                                    sample_rate=entry.sample_rate)
            elif entry.modality == Modality.IMAGE:
                data = torch.from_numpy(np.stack([_decode_png(x, f"{field}.items[{i}]", max_pixels)
                                                  for i, x in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.IMAGE, "decoded", "CHW", source="remote")
            else:
                data = torch.from_numpy(np.stack([np.stack([
                    _decode_png(f, f"{field}.items[{i}][{j}]", max_pixels)
                    for j, f in enumerate(clip)]) for i, clip in enumerate(entry.items)]))
                spec = ArtifactSpec(name, Modality.VIDEO, "decoded", "TCHW", source="remote",
                                    fps=entry.fps)
        except ValueError as e:                 # np.stack of differing shapes
            raise MediaFormatError(f"items differ in shape: {e}", field=field) from None
        out[name] = MediaArtifact(spec, data)
    return out, batch


def output_json(out: ScorerOutput) -> dict[str, Any]:
    """Server side: a ScorerOutput -> the response body."""
    return {"scores": {k: list(v) for k, v in out.scores.items()},
            "status": ["ok" if s == ScoreStatus.OK else "failed" for s in out.status],
            "reasons": list(out.reasons), "metadata": dict(out.metadata)}


class ScoreAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    scores: dict[str, list[float | None]]
    status: list[str] | None = None
    reasons: list[str | None] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


def parse_answer(payload: Any, scorer: str, batch: int) -> ScorerOutput:
    """Client side: a decoded JSON answer -> ScorerOutput; ValueError names what is wrong."""
    try:
        ans = ScoreAnswer.model_validate(payload)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"answer breaks the protocol at {'.'.join(map(str, first['loc']))}: "
                         f"{first['msg']}") from None
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
