"""Explicit scorer construction from config: `build_scorer(ScorerSpec)` -> a Scorer instance.

No import-time registration: the kind -> class table is this module (`_CONFIGURED` and `_build`),
and each class is imported only when its kind is built (model scorers pull in open_clip /
transformers / ImageBind / onnxruntime; the verifiers live in rewards/verifiers/). `video=`
wraps any image scorer to score videos on sampled frames (rewards/frames.py).
"""
from __future__ import annotations

import importlib
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contract import ConfigError
from rewards.base import Scorer
from rewards.frames import FrameSampledScorer, VideoFrames


class ScorerKind(str, Enum):
    IMAGE_ATTRIBUTES = "image_attributes"
    AV_SYNC = "av_sync"
    PITCH_COLOR = "pitch_color"
    CONDITION_FRAME = "condition_frame"
    CLIP = "clip"
    CLIP_DIRECTIONAL = "clip_directional"   # an edit: CLIP image vs caption direction + source
    CLAP = "clap"
    IMAGEBIND = "imagebind"
    OCR = "ocr"                      # RapidOCR PP-OCRv4 (shipped weights), Flow-GRPO OCR reward
    PICKSCORE = "pickscore"          # transformers CLIPModel (PickScore_v1)
    CLIPSCORE = "clipscore"          # transformers CLIPModel, Hessel et al. CLIP-S
    AESTHETIC = "aesthetic"          # LAION aesthetic: CLIP ViT-L/14 image embedding + MLP head
    HPSV2 = "hpsv2"                  # open_clip ViT-H-14 + an HPS v2 / v2.1 checkpoint
    IMAGE_REWARD = "image_reward"    # BLIP (ImageReward.pt + med_config.json)
    REMOTE = "remote"                # an HTTP reward server (JSON, base64 PNG / WAV)
    VLM_JUDGE = "vlm_judge"          # an OpenAI-compatible chat-completions VLM
    EXTERNAL = "external"            # a Scorer class named by import path (isolated envs)
    PICKSCORE_RANK = "pickscore_rank"  # groupwise: PickScore's rank within the prompt group
    VLM_PAIRWISE = "vlm_pairwise"    # groupwise: a VLM judge's pairwise win rate (Pref-GRPO)
    GENEVAL = "geneval"              # GenEval: detector + CLIP colour + count / position rules
    LATENT_HEAD = "latent_head"      # a reward head on the latent (the decode is skipped)


GROUPWISE_KINDS = frozenset({ScorerKind.PICKSCORE_RANK, ScorerKind.VLM_PAIRWISE})


class ScorerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ScorerKind
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="the scorer's config fields / constructor kwargs")
    video: VideoFrames | None = Field(None, description="score a video with this image scorer "
                                      "on uniformly sampled frames (rewards.frames)")

    @model_validator(mode="after")
    def _check_video(self) -> "ScorerSpec":
        if self.video is not None and self.groupwise:
            raise ValueError(f"{self.kind.value} is groupwise: its samples are compared within "
                             "their prompt group, which frame sampling would split into frames")
        return self

    @property
    def groupwise(self) -> bool:
        """Whether the scorer compares the samples of a prompt group (rewards/groupwise.py); a
        remote scorer when its server's scorer does (params.groupwise, rewards/remote.py)."""
        return self.kind in GROUPWISE_KINDS or (self.kind is ScorerKind.REMOTE and
                                                self.params.get("groupwise") is True)


def build_scorer(spec: ScorerSpec) -> Scorer:
    scorer = _build(spec.kind, spec.params)
    return scorer if spec.video is None else FrameSampledScorer(scorer, spec.video)


_CONFIGURED = {   # kind -> (module, scorer class, its pydantic config class)
    ScorerKind.CLIP: ("rewards.clip", "ClipScorer", "ClipScorerConfig"),
    ScorerKind.CLIP_DIRECTIONAL: ("rewards.clip_edit", "ClipDirectionalScorer",
                                  "ClipDirectionalConfig"),
    ScorerKind.CLAP: ("rewards.clap", "ClapScorer", "ClapScorerConfig"),
    ScorerKind.IMAGEBIND: ("rewards.imagebind", "ImageBindScorer", "ImageBindScorerConfig"),
    ScorerKind.OCR: ("rewards.ocr", "OcrScorer", "OcrScorerConfig"),
    ScorerKind.PICKSCORE: ("rewards.hf_clip", "PickScoreScorer", "HFClipScorerConfig"),
    ScorerKind.CLIPSCORE: ("rewards.hf_clip", "ClipScoreScorer", "HFClipScorerConfig"),
    ScorerKind.AESTHETIC: ("rewards.aesthetic", "AestheticScorer", "AestheticScorerConfig"),
    ScorerKind.HPSV2: ("rewards.hps", "HPSv2Scorer", "HPSv2ScorerConfig"),
    ScorerKind.IMAGE_REWARD: ("rewards.image_reward", "ImageRewardScorer",
                              "ImageRewardScorerConfig"),
    ScorerKind.REMOTE: ("rewards.remote", "RemoteScorer", "RemoteScorerConfig"),
    ScorerKind.VLM_JUDGE: ("rewards.vlm_judge", "VLMJudgeScorer", "VLMJudgeScorerConfig"),
    ScorerKind.EXTERNAL: ("rewards.external", "ExternalScorer", "ExternalScorerConfig"),
    ScorerKind.PICKSCORE_RANK: ("rewards.groupwise", "PickScoreRankScorer",
                                "HFClipScorerConfig"),
    ScorerKind.VLM_PAIRWISE: ("rewards.pairwise", "VLMPairwiseScorer", "VLMPairwiseScorerConfig"),
    ScorerKind.GENEVAL: ("rewards.geneval", "GenEvalScorer", "GenEvalScorerConfig"),
    ScorerKind.LATENT_HEAD: ("rewards.latent", "LatentHeadScorer", "LatentHeadScorerConfig"),
}


def validate_spec(spec: ScorerSpec) -> BaseModel | None:
    """The scorer's config validated without building it (no weights loaded): the check a
    config for another machine gets here. None for the verifiers, which take plain kwargs."""
    if spec.kind not in _CONFIGURED:
        return None
    module_name, _, cfg_name = _CONFIGURED[spec.kind]
    return _validate(getattr(importlib.import_module(module_name), cfg_name), spec.params,
                     spec.kind)


def _build(kind: ScorerKind, params: dict[str, Any]) -> Scorer:
    if kind in _CONFIGURED:
        module_name, cls_name, cfg_name = _CONFIGURED[kind]
        module = importlib.import_module(module_name)
        return getattr(module, cls_name)(_validate(getattr(module, cfg_name), params, kind))
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
