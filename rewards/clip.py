"""CLIP score (Hessel et al. 2021, "CLIPScore") with open_clip: image-text, or text-video by frames.

score per sample = cos(E_img(x), E_txt(prompt)); for video the mean over `num_frames` frames sampled
uniformly (the per-frame cosine averaged, as frame-level CLIP scores for video usually are).
Named scores: "cosine" (raw, [-1, 1]) and "clip_score" = map_cosine(cos) ((cos+1)/2 by default).

Weights come from a local file (`pretrained=` with an architecture name), `local-dir:/path` (an
open_clip_config.json + weights file) or `hf-hub:org/repo` resolved from the HF cache with
HF_HUB_OFFLINE=1. Random weights need the explicit `random_init=True` (tests and benches only).
"""
from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import ConfigError, Modality, ScorerOutput
from rewards.base import ScoreRequest
from rewards.embedding import (CLIP_MEAN, CLIP_STD, ScoreMap, cosine, frame_indices, map_cosine,
                               ok_output, pixels_to_model)
from rewards.media import require_decoded, require_prompt_per_sample

_SCHEMAS = ("local-dir:", "hf-hub:")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


class ClipScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "clip"
    model: str = Field("ViT-B-32", description="open_clip architecture, 'local-dir:/p' or 'hf-hub:o/r'")
    pretrained: str | None = Field(None, description="local weights file for an architecture name")
    random_init: bool = Field(False, description="random weights: tests and benches only")
    artifact: str = Field("image", description="decoded artifact to score")
    modality: Modality = Modality.IMAGE
    num_frames: int = Field(8, ge=1, description="frames sampled from a video")
    score_map: ScoreMap = ScoreMap.UNIT
    max_batch: int = Field(32, ge=1, description="images per forward pass")
    device: str = "cpu"
    seed: int = Field(0, description="seed of random_init weights")

    @model_validator(mode="after")
    def _check(self) -> "ClipScorerConfig":
        if self.modality == Modality.AUDIO:
            raise ValueError("CLIP scores images or video, not audio (modality=audio)")
        schema = self.model.startswith(_SCHEMAS)
        if schema and (self.pretrained is not None or self.random_init):
            raise ValueError(f"model={self.model!r} carries its weights; pretrained/random_init "
                             "must be unset")
        if not schema and (self.pretrained is None) == (not self.random_init):
            raise ValueError(f"model={self.model!r}: give exactly one of pretrained=<local file> "
                             f"or random_init=True (got pretrained={self.pretrained!r}, "
                             f"random_init={self.random_init})")
        return self


class ClipScorer:
    """Scorer protocol: decoded image (B,3,H,W) or video (B,T,3,H,W) uint8 + B prompts."""

    primary = "clip_score"

    def __init__(self, config: ClipScorerConfig):
        import open_clip  # heavy import, deferred to construction

        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        _check_weights_present(config)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.seed)
                model, _, _ = open_clip.create_model_and_transforms(
                    config.model, pretrained=config.pretrained, device=config.device)
            self._tokenizer = open_clip.get_tokenizer(config.model)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ConfigError(f"could not build CLIP model {config.model!r}: {e}",
                              field=f"{config.name}.model", actual=config.model) from e
        self._model = model.eval().requires_grad_(False)
        pre = open_clip.get_model_preprocess_cfg(model)
        size = pre.get("size", model.visual.image_size)
        self._size = int(size if isinstance(size, int) else size[0])
        self._mean = tuple(pre.get("mean", CLIP_MEAN))
        self._std = tuple(pre.get("std", CLIP_STD))

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, cfg.modality, self.name)
        batch = art.batch_size
        require_prompt_per_sample(request.prompts, batch, self.name)
        text = self._encode_text(list(request.prompts))                     # (B, D)
        if cfg.modality == Modality.IMAGE:
            cos = cosine(self._encode_images(art.data), text)               # (B,)
        else:
            idx = frame_indices(art.data.shape[1], cfg.num_frames)          # (n,)
            frames = art.data[:, idx]                                       # (B, n, 3, H, W)
            n = frames.shape[1]
            emb = self._encode_images(frames.flatten(0, 1)).view(batch, n, -1)  # (B, n, D)
            cos = cosine(emb, text[:, None].expand_as(emb)).mean(dim=1)    # (B,)
        return ok_output(self.name, {"cosine": cos, "clip_score": map_cosine(cos, cfg.score_map)})

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tokens = self._tokenizer(prompts).to(self.config.device)            # (B, L)
        return self._model.encode_text(tokens).float()

    def _encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 -> (N, D) in chunks of max_batch."""
        out = []
        for chunk in images.split(self.config.max_batch):
            x = pixels_to_model(chunk, self._size, self._mean, self._std).to(self.config.device)
            out.append(self._model.encode_image(x).float())
        return torch.cat(out)


def _check_weights_present(config: ClipScorerConfig) -> None:
    """open_clip only warns when a local dir has no weights; here that is an error."""
    field = f"{config.name}.model"
    if config.model.startswith("local-dir:"):
        path = Path(config.model[len("local-dir:"):])
        if not (path / "open_clip_config.json").is_file():
            raise ConfigError("local-dir has no open_clip_config.json", field=field,
                              actual=str(path))
        if not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir()):
            raise ConfigError("local-dir has no weights file", field=field,
                              expected=list(_WEIGHT_SUFFIXES), actual=sorted(p.name for p in path.iterdir()))
    if config.pretrained is not None and not Path(config.pretrained).is_file():
        raise ConfigError("pretrained weights file not found", field=f"{config.name}.pretrained",
                          actual=config.pretrained)
