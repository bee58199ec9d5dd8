"""Shared pieces of the embedding scorers (CLIP, CLAP, ImageBind): pure tensor functions.

Every scorer here reads decoded media (uint8 pixels, float waveforms) and turns a cosine similarity
into a reward. Two named scores come back per pair: the raw cosine in [-1, 1] and the unit score
`(cos + 1) / 2` in [0, 1] (a monotone map, so rankings and group advantages are unchanged).
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import resample_poly

from contract import ScorerOutput, ScoreStatus

# CLIP's pixel statistics (OpenAI CLIP, Radford et al. 2021), also used by ImageBind's vision tower.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ScoreMap(str, Enum):
    """How a cosine similarity becomes the primary reward."""

    UNIT = "unit"     # (cos + 1) / 2, in [0, 1]
    RAW = "raw"       # cos, in [-1, 1]


def map_cosine(cos: torch.Tensor, score_map: ScoreMap) -> torch.Tensor:
    """cos: (B,) -> (B,) reward under `score_map`."""
    return (cos + 1.0) / 2.0 if score_map == ScoreMap.UNIT else cos


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity. a, b: (B, D) -> (B,)."""
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


def pixels_to_model(images: torch.Tensor, size: int, mean: Sequence[float],
                    std: Sequence[float]) -> torch.Tensor:
    """Resize-shortest-side + centre-crop + normalise, as CLIP's eval transform does
    (torchvision's Resize(size) and CenterCrop(size) geometry: the longer side truncated to
    int(size * long / short), the crop offset round((side - size) / 2)).

    images: (N, 3, H, W) uint8 -> (N, 3, size, size) float32.
    """
    x = images.float() / 255.0
    h, w = x.shape[-2:]
    nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False,
                          antialias=True).clamp_(0.0, 1.0)
    top, left = round((nh - size) / 2.0), round((nw - size) / 2.0)
    x = x[..., top:top + size, left:left + size]
    m = torch.tensor(mean, dtype=x.dtype).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - m) / s


def frame_indices(num_frames: int, num_samples: int) -> torch.Tensor:
    """`num_samples` frame indices spread uniformly over [0, num_frames) (centres of equal bins)."""
    n = min(num_samples, num_frames)
    return ((torch.arange(n, dtype=torch.float64) + 0.5) * num_frames / n).long()


def to_mono(audio: torch.Tensor) -> torch.Tensor:
    """(B, C, N) float -> (B, N) float32 channel mean."""
    return audio.float().mean(dim=1)


def resample(wave: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    """(..., N) float waveform at `sample_rate` -> (..., N') at `target_rate` (polyphase filter)."""
    if sample_rate == target_rate:
        return wave.astype(np.float32, copy=False)
    g = np.gcd(int(sample_rate), int(target_rate))
    up, down = int(target_rate) // g, int(sample_rate) // g
    return resample_poly(wave, up, down, axis=-1).astype(np.float32)


def ok_output(scorer: str, scores: Mapping[str, torch.Tensor],
              metadata: Mapping[str, Any] | None = None) -> ScorerOutput:
    """Named (B,) tensors -> ScorerOutput with every sample OK."""
    named = {k: tuple(float(x) for x in v.detach().cpu().tolist()) for k, v in scores.items()}
    batch = len(next(iter(named.values())))
    return ScorerOutput(scorer=scorer, scores=named, status=(ScoreStatus.OK,) * batch,
                        reasons=(None,) * batch, metadata=dict(metadata or {}))


def pooled_features(out) -> torch.Tensor:
    """get_*_features results: transformers 5 returns a model output with pooler_output, older
    versions a tensor."""
    return (out if isinstance(out, torch.Tensor) else out.pooler_output).float()
