"""Explicit scorer construction from config: `build_scorer(ScorerSpec)` -> a Scorer instance.

No import-time registration: the kind -> class table is this module's `build_scorer` body, and each
class is imported only when its kind is built (model scorers pull in open_clip / transformers /
ImageBind; the verifiers live in rewards/verifiers/).
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract import ConfigError
from rewards.base import Scorer


class ScorerKind(str, Enum):
    IMAGE_ATTRIBUTES = "image_attributes"
    AV_SYNC = "av_sync"
    PITCH_COLOR = "pitch_color"
    CONDITION_FRAME = "condition_frame"
    CLIP = "clip"
    CLAP = "clap"
    IMAGEBIND = "imagebind"


class ScorerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ScorerKind
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="the scorer's config fields / constructor kwargs")


def build_scorer(spec: ScorerSpec) -> Scorer:
    kind, params = spec.kind, spec.params
    if kind == ScorerKind.CLIP:
        from rewards.clip import ClipScorer, ClipScorerConfig
        return ClipScorer(_validate(ClipScorerConfig, params, kind))
    if kind == ScorerKind.CLAP:
        from rewards.clap import ClapScorer, ClapScorerConfig
        return ClapScorer(_validate(ClapScorerConfig, params, kind))
    if kind == ScorerKind.IMAGEBIND:
        from rewards.imagebind import ImageBindScorer, ImageBindScorerConfig
        return ImageBindScorer(_validate(ImageBindScorerConfig, params, kind))
    if kind == ScorerKind.IMAGE_ATTRIBUTES:
        from rewards.verifiers.image import ImageAttributeScorer as cls
    elif kind == ScorerKind.AV_SYNC:
        from rewards.verifiers.av import AVSyncScorer as cls
    elif kind == ScorerKind.PITCH_COLOR:
        from rewards.verifiers.av import PitchColorScorer as cls
    elif kind == ScorerKind.CONDITION_FRAME:
        from rewards.verifiers.av import ConditionFrameScorer as cls
    else:  # pragma: no cover -- every ScorerKind is handled above
        raise ConfigError("unhandled scorer kind", field="kind", actual=kind.value)
    try:
        return cls(**params)
    except TypeError as e:
        raise ConfigError(f"bad parameters for scorer kind {kind.value!r}: {e}",
                          field=f"{kind.value}.params", actual=sorted(params)) from e


def _validate(config_cls: type[BaseModel], params: dict[str, Any], kind: ScorerKind):
    try:
        return config_cls.model_validate(params)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid {kind.value} scorer config: {first['msg']}",
                          field=f"{kind.value}.params.{loc}" if loc else f"{kind.value}.params",
                          actual=first.get("input")) from e
