"""Adapter-declared media I/O and named typed artifacts (RFC 4.4-4.5).

Rules: data.dtype is authoritative (decoded pixels uint8, decoded audio float, latents their real
float dtype); latent is a representation, never a modality; a decoded artifact needs fps / sample
rate where its modality requires one; missing / undeclared / duplicate artifacts are errors.
Every artifact's data has a leading batch axis B followed by the axes its layout names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from contract.enums import DECODED_LAYOUT, Layout, Modality, Representation
from contract.errors import (ConfigError, DuplicateInputError, MediaFormatError,
                             MissingArtifactError, NonFiniteError, UnexpectedArtifactError)


@dataclass(frozen=True)
class ArtifactSpec:
    """One named output an adapter can produce."""

    name: str
    modality: Modality
    representation: Representation
    layout: Layout
    fps: float | None = None           # default for video
    sample_rate: int | None = None     # default for audio
    source: str | None = None          # decoded artifacts: the latent artifact they decode from

    def __post_init__(self) -> None:
        for attr, enum in (("modality", Modality), ("representation", Representation),
                           ("layout", Layout)):
            value = getattr(self, attr)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, attr, enum(value))
                except ValueError:
                    raise ConfigError(f"unknown {attr} for artifact {self.name!r}", field=attr,
                                      expected=[e.value for e in enum], actual=value) from None
        if self.representation == Representation.DECODED:
            want = DECODED_LAYOUT[self.modality]
            if self.layout != want:
                raise ConfigError(f"decoded {self.modality.value} artifact {self.name!r} must use "
                                  f"layout {want.value}", field="layout", expected=want.value,
                                  actual=self.layout.value)
            if self.source is None:
                raise ConfigError(f"decoded artifact {self.name!r} must name its latent source",
                                  field="source")
        elif not self.layout.is_latent:
            raise ConfigError(f"latent artifact {self.name!r} needs a latent layout",
                              field="layout", actual=self.layout.value)


@dataclass(frozen=True)
class IOSpec:
    """Everything an adapter can return, by name, plus the default request."""

    artifacts: tuple[ArtifactSpec, ...]
    defaults: tuple[str, ...]

    def __post_init__(self) -> None:
        names = [a.name for a in self.artifacts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise DuplicateInputError("IOSpec declares an artifact name twice", field="artifacts",
                                      actual=dupes)
        by_name = {a.name: a for a in self.artifacts}
        for name in self.defaults:
            if name not in by_name:
                raise ConfigError("default artifact is not declared", field="defaults",
                                  expected=names, actual=name)
        for a in self.artifacts:
            if a.source is not None and (a.source not in by_name or
                                         by_name[a.source].representation != Representation.LATENT):
                raise ConfigError(f"artifact {a.name!r} decodes from {a.source!r}, which is not a "
                                  "declared latent artifact", field="source", actual=a.source)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.artifacts)

    def __getitem__(self, name: str) -> ArtifactSpec:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise KeyError(name)

    def latent_needed(self, requested: Sequence[str]) -> tuple[str, ...]:
        """Latent artifacts the rollout must produce for `requested` (decoded ones need sources)."""
        out: list[str] = []
        for name in requested:
            spec = self[name]
            latent = spec.name if spec.representation == Representation.LATENT else spec.source
            if latent not in out:
                out.append(latent)
        return tuple(out)


@dataclass(frozen=True)
class MediaArtifact:
    """Spec + data (B, *layout) + metadata (e.g. actual fps / sample_rate)."""

    spec: ArtifactSpec
    data: torch.Tensor
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def fps(self) -> float | None:
        return self.metadata.get("fps", self.spec.fps)

    @property
    def sample_rate(self) -> int | None:
        return self.metadata.get("sample_rate", self.spec.sample_rate)

    @property
    def batch_size(self) -> int:
        return int(self.data.shape[0])

    def summary(self) -> dict[str, Any]:
        """JSON-safe description (no data)."""
        out = {"name": self.name, "modality": self.spec.modality.value,
               "representation": self.spec.representation.value, "layout": self.spec.layout.value,
               "shape": list(self.data.shape), "dtype": str(self.data.dtype).replace("torch.", "")}
        if self.fps is not None:
            out["fps"] = self.fps
        if self.sample_rate is not None:
            out["sample_rate"] = self.sample_rate
        return out


def validate_artifact(artifact: MediaArtifact, request_id: str | None = None) -> None:
    """Check dtype, rank, finiteness and required rates of one artifact."""
    spec, data, field_name = artifact.spec, artifact.data, f"artifacts.{artifact.name}"
    if not isinstance(data, torch.Tensor):
        raise MediaFormatError("artifact data must be a torch.Tensor", field=field_name,
                               actual=type(data).__name__, request_id=request_id)
    if data.ndim != spec.layout.ndim + 1:
        raise MediaFormatError(f"layout {spec.layout.value} needs B + {spec.layout.ndim} axes",
                               field=f"{field_name}.shape", expected=spec.layout.ndim + 1,
                               actual=tuple(data.shape), request_id=request_id)
    decoded = spec.representation == Representation.DECODED
    if decoded and spec.modality in (Modality.IMAGE, Modality.VIDEO):
        if data.dtype != torch.uint8:
            raise MediaFormatError("decoded pixels must be uint8 [0, 255]",
                                   field=f"{field_name}.dtype", expected="torch.uint8",
                                   actual=str(data.dtype), request_id=request_id)
    elif not data.is_floating_point():
        what = "decoded audio" if decoded else "a latent"
        raise MediaFormatError(f"{what} must be a floating tensor", field=f"{field_name}.dtype",
                               expected="floating", actual=str(data.dtype), request_id=request_id)
    if data.is_floating_point() and not bool(torch.isfinite(data).all()):
        raise NonFiniteError("artifact holds NaN/Inf", field=field_name, request_id=request_id)
    if decoded and spec.modality == Modality.VIDEO and not artifact.fps:
        raise MediaFormatError("decoded video needs fps", field=f"{field_name}.fps",
                               expected="> 0", actual=artifact.fps, request_id=request_id)
    if decoded and spec.modality == Modality.AUDIO and not artifact.sample_rate:
        raise MediaFormatError("decoded audio needs a sample rate",
                               field=f"{field_name}.sample_rate", expected="> 0",
                               actual=artifact.sample_rate, request_id=request_id)


def collect_artifacts(io_spec: IOSpec, requested: Sequence[str],
                      produced: Sequence[MediaArtifact],
                      request_id: str | None = None) -> dict[str, MediaArtifact]:
    """Validate a producer's output against what was requested; returns name -> artifact."""
    out: dict[str, MediaArtifact] = {}
    for artifact in produced:
        name = artifact.name
        if name in out:
            raise DuplicateInputError("artifact returned twice", field=f"artifacts.{name}",
                                      request_id=request_id)
        if name not in io_spec.names:
            raise UnexpectedArtifactError("returned artifact is not declared",
                                          field=f"artifacts.{name}", expected=list(io_spec.names),
                                          actual=name, request_id=request_id)
        if name not in requested:
            raise UnexpectedArtifactError("returned artifact was not requested",
                                          field=f"artifacts.{name}", expected=list(requested),
                                          actual=name, request_id=request_id)
        if artifact.spec != io_spec[name]:
            raise UnexpectedArtifactError("returned artifact's spec differs from the declared one",
                                          field=f"artifacts.{name}", expected=io_spec[name],
                                          actual=artifact.spec, request_id=request_id)
        validate_artifact(artifact, request_id)
        out[name] = artifact
    for name in requested:
        if name not in out:
            raise MissingArtifactError("requested artifact was not produced",
                                       field=f"artifacts.{name}", expected=list(requested),
                                       actual=sorted(out), request_id=request_id)
    return out
