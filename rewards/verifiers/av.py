"""Rule verifiers for decoded video + audio clips (the synthetic bouncing-square world).

- `AVSyncScorer`: temporal synchrony in the spirit of AV-Align (Yariv et al., AAAI 2024): the IoU
  of audio onset peaks (spectral flux, binned per video frame) and visual motion peaks (bounces of
  the moving object's centroid), matched one-to-one within +-1 frame. It measures synchrony only,
  not what the sound or the picture is.
- `PitchColorScorer`: the dominant pitch of the audio against the colour the caption asks for and
  the colour seen in the video (`synthetic.clips` palette: red 440 Hz ... yellow 1100 Hz).
- `ConditionFrameScorer`: FL2VA fidelity of the first / last generated frame to the condition
  frames given in `ScoreRequest.metadata[i]["first_frame" / "last_frame"]` (PSNR mapped to [0, 1]).

All read decoded media through `require_decoded` and refuse latents, missing fps / sample rate.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from contract import Modality, ScorerOutput, ScoreStatus
from contract.errors import InvalidRequestError, MediaFormatError
from rewards.base import ScoreRequest
from rewards.media import require_decoded, require_prompt_per_sample
from synthetic.clips import PITCH_HZ, RGB, Color, parse_caption

FG_THRESHOLD = 40.0        # uint8 distance from the background that counts as the object


# ---- pure feature extractors -------------------------------------------------------------------
def audio_onset_frames(audio: np.ndarray, sample_rate: int, fps: float, num_frames: int,
                       rel_threshold: float = 0.3, abs_threshold: float = 0.5) -> list[int]:
    """Frames holding an audio onset. audio: (C, N) float. Spectral flux (positive magnitude
    increase summed over bins, Bello et al. 2005) per STFT hop, max-pooled per video frame, then
    frames that are local maxima above max(rel * peak, abs) are onsets."""
    x = torch.as_tensor(audio, dtype=torch.float32).mean(0)                     # (N,)
    n_fft, hop = 512, max(1, int(round(sample_rate / fps / 8)))
    spec = torch.stft(x, n_fft, hop_length=hop, window=torch.hann_window(n_fft),
                      return_complex=True).abs()                               # (F, H)
    flux = torch.relu(spec[:, 1:] - spec[:, :-1]).sum(0)                        # (H-1,)
    times = (torch.arange(1, spec.shape[1]) * hop) / sample_rate               # hop centres (s)
    frame_of_hop = torch.round(times * fps).long()
    strength = np.zeros(num_frames)
    for k in range(num_frames):
        sel = flux[frame_of_hop == k]
        strength[k] = float(sel.max()) if sel.numel() else 0.0
    return _peaks(strength, max(rel_threshold * strength.max(), abs_threshold))


def _peaks(strength: np.ndarray, threshold: float) -> list[int]:
    out = []
    for k, s in enumerate(strength):
        left = strength[k - 1] if k > 0 else -np.inf
        right = strength[k + 1] if k + 1 < len(strength) else -np.inf
        if s >= threshold and s >= left and s > right:
            out.append(k)
    return out


def object_track(video: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Centroid (T, 2) [row, col] of the foreground and its mask (T, H, W). video: (T, 3, H, W)
    uint8. The background is the per-pixel temporal median; frames without foreground get NaN."""
    v = video.astype(np.float32)
    background = np.median(v, axis=0, keepdims=True)
    diff = np.abs(v - background).max(axis=1)                                   # (T, H, W)
    mask = diff > FG_THRESHOLD
    rows, cols = np.mgrid[0:v.shape[2], 0:v.shape[3]]
    cent = np.full((v.shape[0], 2), np.nan)
    for t in range(v.shape[0]):
        w = diff[t] * mask[t]
        if w.sum() > 0:
            cent[t] = ((rows * w).sum() / w.sum(), (cols * w).sum() / w.sum())
    return cent, mask


def bounce_frames(video: np.ndarray, min_travel: float = 1.0) -> list[int]:
    """Frames where the object's centroid reverses direction along its main axis of motion."""
    cent, _ = object_track(video)
    ok = ~np.isnan(cent[:, 0])
    if ok.sum() < 3:
        return []
    axis = int(np.argmax(np.nanvar(cent, axis=0)))
    pos = cent[:, axis]
    out: list[int] = []
    last_dir, last_end = 0.0, 0          # direction of the latest real move and the frame it ended
    for k in range(1, len(pos)):
        if not (ok[k - 1] and ok[k]):
            last_dir = 0.0
            continue
        step = pos[k] - pos[k - 1]
        if abs(step) < min_travel / 2:   # a plateau: the object rests (or sits at the wall)
            continue
        if last_dir * step < 0:          # reversal: the bounce is where the previous move ended
            out.append(last_end)
        last_dir, last_end = step, k
    return out


def peak_iou(a: list[int], b: list[int], tolerance: int = 1) -> float:
    """IoU of two peak sets, matched greedily one-to-one within +-tolerance frames (AV-Align)."""
    if not a and not b:
        return 0.0   # no events at all: no synchrony is shown (every prompt asks for bounces)
    unused = list(b)
    matched = 0
    for x in a:
        best = min(unused, key=lambda y: abs(y - x), default=None)
        if best is not None and abs(best - x) <= tolerance:
            unused.remove(best)
            matched += 1
    return matched / (len(a) + len(b) - matched)


def dominant_pitch(audio: np.ndarray, sample_rate: int, fmin: float = 100.0,
                   fmax: float = 4000.0) -> float:
    """Frequency (Hz) of the strongest spectral peak in [fmin, fmax], parabolic interpolation."""
    x = np.asarray(audio, dtype=np.float64).mean(0)
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    freqs = np.fft.rfftfreq(len(x), 1.0 / sample_rate)
    band = np.where((freqs >= fmin) & (freqs <= fmax))[0]
    i = int(band[np.argmax(spec[band])])
    if 0 < i < len(spec) - 1:
        a, b, c = np.log(spec[i - 1] + 1e-12), np.log(spec[i] + 1e-12), np.log(spec[i + 1] + 1e-12)
        denom = a - 2 * b + c
        i = i + (0.5 * (a - c) / denom if denom != 0 else 0.0)
    return float(i * sample_rate / len(x))


def pitch_match(hz: float, target_hz: float, sigma_semitones: float = 1.0) -> float:
    """Gaussian in semitones: 1 at the target, ~0 one palette step away (>= 3.9 semitones)."""
    d = 12.0 * math.log2(max(hz, 1e-6) / target_hz)
    return math.exp(-0.5 * (d / sigma_semitones) ** 2)


def seen_color(video: np.ndarray) -> Color | None:
    """Palette colour nearest to the mean foreground RGB; None when nothing stands out."""
    _, mask = object_track(video)
    if not mask.any():
        return None
    rgb = video.astype(np.float32).transpose(0, 2, 3, 1)[mask].mean(0)            # (3,)
    return min(Color, key=lambda c: float(np.sum((rgb - np.array(RGB[c])) ** 2)))


def psnr_score(a: np.ndarray, b: np.ndarray, lo: float = 16.0, hi: float = 40.0) -> float:
    """PSNR of two uint8 frames mapped linearly from [lo, hi] dB to [0, 1]."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    psnr = 99.0 if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)
    return min(max((psnr - lo) / (hi - lo), 0.0), 1.0)


# ---- scorers ----------------------------------------------------------------------------------
def _ok(name: str, scores: dict[str, list[float]], n: int) -> ScorerOutput:
    return ScorerOutput(scorer=name, scores={k: tuple(v) for k, v in scores.items()},
                        status=(ScoreStatus.OK,) * n, reasons=(None,) * n)


class _VideoAudioScorer:
    """Shared set-up of the scorers that read one decoded video and one decoded audio."""

    primary: str

    def __init__(self, video: str = "video", audio: str = "audio", name: str | None = None):
        self.name = name or self.primary
        self.video_name, self.audio_name = video, audio
        self.required_artifacts = (video, audio)

    def _media(self, request: ScoreRequest):
        video = require_decoded(request.artifacts, self.video_name, Modality.VIDEO, self.name)
        audio = require_decoded(request.artifacts, self.audio_name, Modality.AUDIO, self.name)
        _same_batch(self.name, video.batch_size, audio.batch_size)
        return video, audio


class AVSyncScorer(_VideoAudioScorer):
    """IoU of audio onset frames and visual bounce frames (+-1 frame), in [0, 1]."""

    primary = "av_sync"

    def score(self, request: ScoreRequest) -> ScorerOutput:
        video, audio = self._media(request)
        v, a = video.data.cpu().numpy(), audio.data.detach().cpu().float().numpy()
        out: dict[str, list[float]] = {"av_sync": [], "num_audio_onsets": [], "num_bounces": []}
        for i in range(video.batch_size):
            onsets = audio_onset_frames(a[i], int(audio.sample_rate), float(video.fps), v.shape[1])
            bounces = bounce_frames(v[i])
            out["av_sync"].append(peak_iou(onsets, bounces))
            out["num_audio_onsets"].append(float(len(onsets)))
            out["num_bounces"].append(float(len(bounces)))
        return _ok(self.name, out, video.batch_size)


class PitchColorScorer(_VideoAudioScorer):
    """Dominant pitch vs the caption's colour (pitch_caption) and vs the colour seen in the video
    (pitch_video); primary = the smaller of the two."""

    primary = "pitch_color"

    def score(self, request: ScoreRequest) -> ScorerOutput:
        video, audio = self._media(request)
        require_prompt_per_sample(request.prompts, video.batch_size, self.name)
        v, a = video.data.cpu().numpy(), audio.data.detach().cpu().float().numpy()
        out: dict[str, list[float]] = {"pitch_color": [], "pitch_caption": [], "pitch_video": [],
                                       "pitch_hz": []}
        for i in range(video.batch_size):
            want = parse_caption(request.prompts[i])
            hz = dominant_pitch(a[i], int(audio.sample_rate))
            seen = seen_color(v[i])
            by_caption = pitch_match(hz, want.pitch_hz)
            by_video = 0.0 if seen is None else pitch_match(hz, PITCH_HZ[seen])
            out["pitch_color"].append(min(by_caption, by_video))
            out["pitch_caption"].append(by_caption)
            out["pitch_video"].append(by_video)
            out["pitch_hz"].append(hz)
        return _ok(self.name, out, video.batch_size)


class ConditionFrameScorer:
    """FL2VA: PSNR-based fidelity of generated first/last frames to the condition frames."""

    primary = "condition_frames"
    roles = ("first_frame", "last_frame")

    def __init__(self, video: str = "video", name: str = "condition_frames"):
        self.name = name
        self.video_name = video
        self.required_artifacts = (video,)

    def score(self, request: ScoreRequest) -> ScorerOutput:
        video = require_decoded(request.artifacts, self.video_name, Modality.VIDEO, self.name)
        if len(request.metadata) != video.batch_size:
            raise InvalidRequestError(f"scorer {self.name!r} needs one metadata dict per sample",
                                      field=f"{self.name}.metadata", expected=video.batch_size,
                                      actual=len(request.metadata))
        v = video.data.cpu().numpy()
        out: dict[str, list[float]] = {"condition_frames": [], "first_frame": [], "last_frame": []}
        for i in range(video.batch_size):
            per_role = {}
            for role, frame in zip(self.roles, (v[i, 0], v[i, -1])):
                field = f"{self.name}.metadata[{i}].{role}"
                if role not in request.metadata[i]:
                    raise InvalidRequestError(f"FL2VA fidelity needs the {role} condition",
                                              field=field, expected="uint8 (3, H, W)",
                                              actual=sorted(request.metadata[i]))
                cond = torch.as_tensor(request.metadata[i][role])
                if cond.dtype != torch.uint8 or tuple(cond.shape) != frame.shape:
                    raise MediaFormatError("condition frame must be uint8 shaped like a frame",
                                           field=field, expected=f"uint8 {frame.shape}",
                                           actual=f"{cond.dtype} {tuple(cond.shape)}")
                per_role[role] = psnr_score(frame, cond.numpy())
            out["first_frame"].append(per_role["first_frame"])
            out["last_frame"].append(per_role["last_frame"])
            out["condition_frames"].append(0.5 * (per_role["first_frame"] + per_role["last_frame"]))
        return _ok(self.name, out, video.batch_size)


def _same_batch(scorer: str, b_video: int, b_audio: int) -> None:
    if b_video != b_audio:
        raise MediaFormatError(f"scorer {scorer!r} needs video and audio of the same batch",
                               field=f"{scorer}.artifacts", expected=b_video, actual=b_audio)
