"""Kaldi-style log-mel filterbank features in plain torch (no torchaudio).

Follows the Kaldi feature pipeline (Povey et al. 2011, "The Kaldi Speech Recognition Toolkit";
`compute-fbank-feats` defaults) for snip_edges=True, dither=0, use_energy=False:
  frames  x_f[n] = x[f*shift + n], n < L                    L = frame_length, f = 0..F-1
  DC      x_f <- x_f - mean(x_f)
  preemph x_f[n] <- x_f[n] - p * x_f[n-1]   (x_f[-1] := x_f[0])
  window  x_f <- x_f * w                    w: symmetric Hann (or Povey = Hann^0.85)
  power   P_f[k] = |FFT_K(x_f)[k]|^2,  K = next power of two >= L,  k = 0..K/2
  mel     E_f[m] = sum_k P_f[k] H_m[k],  H_m triangles on mel(f) = 1127 ln(1 + f/700)
  log     log(max(E_f[m], eps))
"""
from __future__ import annotations

import math

import torch


def mel_scale(freq: torch.Tensor) -> torch.Tensor:
    """Hz -> mel (Kaldi / HTK natural-log form)."""
    return 1127.0 * torch.log1p(freq / 700.0)


def mel_filterbank(num_mel_bins: int, fft_size: int, sample_rate: float,
                   low_freq: float = 20.0, high_freq: float | None = None) -> torch.Tensor:
    """Triangular filters equally spaced in mel: (num_mel_bins, fft_size // 2 + 1).

    The Nyquist column is zero, as in Kaldi (filters span FFT bins 0 .. K/2 - 1).
    """
    nyquist = 0.5 * sample_rate
    high = nyquist if high_freq is None or high_freq <= 0 else high_freq
    mel_low, mel_high = mel_scale(torch.tensor(low_freq)), mel_scale(torch.tensor(high))
    delta = (mel_high - mel_low) / (num_mel_bins + 1)
    m = torch.arange(num_mel_bins, dtype=torch.float64).unsqueeze(1)       # (M, 1)
    left, center, right = mel_low + m * delta, mel_low + (m + 1) * delta, mel_low + (m + 2) * delta
    bins = fft_size // 2
    mel = mel_scale(sample_rate / fft_size * torch.arange(bins, dtype=torch.float64))  # (K/2,)
    up = (mel - left) / (center - left)                                   # (M, K/2)
    down = (right - mel) / (right - center)
    weights = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.nn.functional.pad(weights, (0, 1)).float()              # (M, K/2 + 1)


def kaldi_fbank(wave: torch.Tensor, sample_rate: float, num_mel_bins: int = 128,
                frame_length_ms: float = 25.0, frame_shift_ms: float = 10.0,
                preemphasis: float = 0.97, window: str = "hanning",
                low_freq: float = 20.0) -> torch.Tensor:
    """wave: (N,) float -> (F, num_mel_bins) log-mel energies, F = 1 + (N - L) // shift."""
    length = int(sample_rate * frame_length_ms / 1000.0)
    shift = int(sample_rate * frame_shift_ms / 1000.0)
    wave = wave.to(torch.float64)
    if wave.ndim != 1 or wave.shape[0] < length:
        raise ValueError(f"kaldi_fbank needs a 1-D waveform of at least {length} samples, "
                         f"got shape {tuple(wave.shape)}")
    frames = wave.unfold(0, length, shift)                                # (F, L)
    frames = frames - frames.mean(dim=1, keepdim=True)
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - preemphasis * prev
    if window == "hanning":
        w = torch.hann_window(length, periodic=False, dtype=torch.float64)
    elif window == "povey":
        w = torch.hann_window(length, periodic=False, dtype=torch.float64).pow(0.85)
    else:
        raise ValueError(f"unknown window {window!r}; expected 'hanning' or 'povey'")
    fft_size = 1 << math.ceil(math.log2(length))
    power = torch.fft.rfft(frames * w, n=fft_size).abs().pow(2)          # (F, K/2 + 1)
    fb = mel_filterbank(num_mel_bins, fft_size, sample_rate, low_freq).to(torch.float64)
    energies = power @ fb.T                                               # (F, M)
    eps = torch.finfo(torch.float32).eps
    return torch.log(energies.clamp_min(eps)).float()
