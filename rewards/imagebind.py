"""ImageBind scores (Girdhar et al. 2023, "ImageBind: One Embedding Space To Bind Them All").

Pairs: text-video, text-audio and audio-video, each cos(E_a, E_b) in the joint space; named scores
"<pair>_cosine" ([-1, 1]) and "<pair>" = map_cosine(cos) ((cos+1)/2 by default).

LICENCE: the ImageBind code and weights are CC BY-NC-SA 4.0 (non-commercial). They are not part of
this project; the optional `imagebind` extra installs them:
    pip install -c constraints.txt ".[imagebind]"
    pip install --no-deps imagebind-unofficial==0.1.1
(--no-deps: its declared deps pull torchaudio/pytorchvideo/decord, which do not import here). Its
package __init__ imports those data loaders, so only `imagebind.models` is loaded (see
`_import_imagebind`). Audio features use rewards.fbank (Kaldi fbank in torch), not torchaudio.

Preprocessing (per sample, as ImageBind's eval transforms, with one centre crop per clip):
  video (T, 3, H, W) uint8 @ fps -> `clips` clips of `video_frames` frames each, spread over the
        clip windows (`clip_duration_s` long, start times uniform over the video) -> 224 crop
  audio (C, N) float @ sr -> mono, 16 kHz, `clips` windows -> 128-bin fbank, 204 frames,
        (x - (-4.268)) / 9.138
Real weights: `checkpoint=<local imagebind_huge.pth>` with the default (huge) dims. Random weights
need `random_init=True` and give meaningless scores (tests / benches only).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import ConfigError, InvalidRequestError, Modality, ScorerOutput
from rewards.base import ScoreRequest
from rewards.embedding import (CLIP_MEAN, CLIP_STD, ScoreMap, cosine, map_cosine, ok_output,
                               pixels_to_model, resample, to_mono)
from rewards.fbank import kaldi_fbank
from rewards.media import require_decoded, require_prompt_per_sample

INSTALL_HINT = ('pip install -c constraints.txt ".[imagebind]" && '
                "pip install --no-deps imagebind-unofficial==0.1.1")
AUDIO_RATE = 16_000
AUDIO_MEAN, AUDIO_STD = -4.268, 9.138
IMAGE_SIZE = 224

# ImageBindModel kwargs of the released "huge" model (1.2 B params).
HUGE_DIMS: dict[str, Any] = dict(vision_embed_dim=1280, vision_num_blocks=32, vision_num_heads=16,
                                 text_embed_dim=1024, text_num_blocks=24, text_num_heads=16,
                                 out_embed_dim=1024, audio_drop_path=0.1, imu_drop_path=0.7)


class ImageBindPair(str, Enum):
    TEXT_VIDEO = "text_video"
    TEXT_AUDIO = "text_audio"
    AUDIO_VIDEO = "audio_video"


class ImageBindScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "imagebind"
    pairs: tuple[ImageBindPair, ...] = (ImageBindPair.AUDIO_VIDEO,)
    primary: ImageBindPair | None = Field(None, description="reward pair; default pairs[0]")
    checkpoint: str | None = Field(None, description="local .pth state dict")
    random_init: bool = Field(False, description="random weights: tests and benches only")
    dims: dict[str, Any] = Field(default_factory=lambda: dict(HUGE_DIMS),
                                 description="ImageBindModel kwargs (default: huge)")
    video_artifact: str = "video"
    audio_artifact: str = "audio"
    clips: int = Field(3, ge=1, description="temporal clips per sample (embeddings averaged)")
    clip_duration_s: float = Field(2.0, gt=0)
    score_map: ScoreMap = ScoreMap.UNIT
    device: str = "cpu"
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "ImageBindScorerConfig":
        if not self.pairs or len(set(self.pairs)) != len(self.pairs):
            raise ValueError(f"pairs must be non-empty and distinct, got {self.pairs}")
        if self.primary is not None and self.primary not in self.pairs:
            raise ValueError(f"primary={self.primary.value!r} is not in pairs")
        if (self.checkpoint is None) == (not self.random_init):
            raise ValueError("give exactly one of checkpoint=<local .pth> or random_init=True")
        return self


class ImageBindScorer:
    """Scorer protocol over decoded video (B,T,3,H,W) uint8 and/or audio (B,C,N) float."""

    def __init__(self, config: ImageBindScorerConfig):
        self.config = config
        self.name = config.name
        self.primary = (config.primary or config.pairs[0]).value
        uses = {m for p in config.pairs for m in p.value.split("_")}
        self.required_artifacts = tuple(a for m, a in (("video", config.video_artifact),
                                                      ("audio", config.audio_artifact)) if m in uses)
        self._uses = uses
        model_cls, self._modality, tokenizer_cls, bpe = _import_imagebind(config.name)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.seed)
                model = model_cls(**config.dims)
        except TypeError as e:
            raise ConfigError(f"bad ImageBind dims: {e}", field=f"{config.name}.dims",
                              actual=config.dims) from e
        if config.checkpoint is not None:
            path = Path(config.checkpoint)
            if not path.is_file():
                raise ConfigError("ImageBind checkpoint not found",
                                  field=f"{config.name}.checkpoint", actual=str(path))
            try:
                model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except RuntimeError as e:
                raise ConfigError(f"checkpoint does not fit the dims: {e}",
                                  field=f"{config.name}.checkpoint", actual=str(path)) from e
        self._model = model.to(config.device).eval().requires_grad_(False)
        self._tokenizer = tokenizer_cls(bpe_path=bpe)
        self._video_frames = int(config.dims.get("video_frames", 2))
        self._mel_bins = int(config.dims.get("audio_num_mel_bins", 128))
        self._target_len = int(config.dims.get("audio_target_len", 204))

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg, arts, batch = self.config, request.artifacts, None
        inputs: dict[str, torch.Tensor] = {}
        if "video" in self._uses:
            video = require_decoded(arts, cfg.video_artifact, Modality.VIDEO, self.name)
            batch = video.batch_size
            inputs[self._modality.VISION] = self._video_input(video.data, float(video.fps))
        if "audio" in self._uses:
            audio = require_decoded(arts, cfg.audio_artifact, Modality.AUDIO, self.name)
            if batch is not None and audio.batch_size != batch:
                raise InvalidRequestError("video and audio batch sizes differ",
                                          field=f"{self.name}.artifacts.{cfg.audio_artifact}",
                                          expected=batch, actual=audio.batch_size)
            batch = audio.batch_size
            inputs[self._modality.AUDIO] = self._audio_input(audio.data, int(audio.sample_rate))
        if "text" in self._uses:
            require_prompt_per_sample(request.prompts, batch, self.name)
            inputs[self._modality.TEXT] = self._tokenizer(list(request.prompts))
        emb = self._model({k: v.to(cfg.device) for k, v in inputs.items()})  # each (B, D)
        key = {"video": self._modality.VISION, "audio": self._modality.AUDIO,
               "text": self._modality.TEXT}
        scores: dict[str, torch.Tensor] = {}
        for pair in cfg.pairs:
            a, b = pair.value.split("_")
            cos = cosine(emb[key[a]], emb[key[b]])
            scores[f"{pair.value}_cosine"] = cos
            scores[pair.value] = map_cosine(cos, cfg.score_map)
        return ok_output(self.name, scores)

    def _windows(self, duration_s: float) -> tuple[torch.Tensor, float]:
        """Start times (clips,) and length of the clip windows over a `duration_s` long sample."""
        length = min(self.config.clip_duration_s, duration_s)
        return torch.linspace(0.0, duration_s - length, self.config.clips,
                              dtype=torch.float64), length

    def _video_input(self, video: torch.Tensor, fps: float) -> torch.Tensor:
        """(B, T, 3, H, W) uint8 -> (B, clips, 3, video_frames, 224, 224) float."""
        b, t = video.shape[:2]
        starts, length = self._windows(t / fps)
        k = torch.arange(self._video_frames, dtype=torch.float64)
        times = starts[:, None] + (k[None] + 0.5) * length / self._video_frames   # (clips, n)
        idx = (times * fps).long().clamp_(0, t - 1).flatten()                    # (clips*n,)
        frames = video[:, idx].flatten(0, 1)                                      # (B*clips*n,3,H,W)
        x = pixels_to_model(frames, IMAGE_SIZE, CLIP_MEAN, CLIP_STD)
        x = x.view(b, self.config.clips, self._video_frames, 3, IMAGE_SIZE, IMAGE_SIZE)
        return x.permute(0, 1, 3, 2, 4, 5).contiguous()

    def _audio_input(self, audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """(B, C, N) float -> (B, clips, 1, mel_bins, target_len) normalised log-mel."""
        wave = torch.from_numpy(resample(to_mono(audio).cpu().numpy(), sample_rate, AUDIO_RATE))
        starts, length = self._windows(wave.shape[-1] / AUDIO_RATE)
        n = int(round(length * AUDIO_RATE))
        out = []
        for row in wave:                                                   # (N,)
            clips = []
            for s in starts.tolist():
                start = int(round(s * AUDIO_RATE))
                clip = row[start:start + n]
                clip = F.pad(clip, (0, max(0, 400 - clip.shape[0])))        # >= one 25 ms frame
                mel = kaldi_fbank(clip - clip.mean(), AUDIO_RATE, self._mel_bins).T  # (M, F)
                mel = F.pad(mel, (0, max(0, self._target_len - mel.shape[1])))
                mel = mel[:, :self._target_len]
                clips.append(((mel - AUDIO_MEAN) / AUDIO_STD)[None])      # (1, M, target)
            out.append(torch.stack(clips))
        return torch.stack(out)


def _import_imagebind(scorer: str):
    """Load imagebind.models without running imagebind/__init__.py (which imports torchaudio,
    pytorchvideo and pkg_resources for its file loaders). Raises ConfigError if missing."""
    try:
        if "imagebind" not in sys.modules:
            spec = importlib.util.find_spec("imagebind")
            if spec is None or not spec.submodule_search_locations:
                raise ImportError("package 'imagebind' (imagebind-unofficial) is not installed")
            pkg = types.ModuleType("imagebind")
            pkg.__path__ = list(spec.submodule_search_locations)
            sys.modules["imagebind"] = pkg
        from imagebind.models.imagebind_model import ImageBindModel, ModalityType
        from imagebind.models.multimodal_preprocessors import SimpleTokenizer
    except ImportError as e:
        raise ConfigError(f"ImageBind is not importable: {e}", field=f"{scorer}.package",
                          expected=INSTALL_HINT, actual=repr(e)) from e
    root = Path(sys.modules["imagebind"].__path__[0])
    return ImageBindModel, ModalityType, SimpleTokenizer, str(root / "bpe" / "bpe_simple_vocab_16e6.txt.gz")
