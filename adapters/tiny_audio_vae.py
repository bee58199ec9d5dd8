"""A small 1-D KL autoencoder for 16 kHz mono waveforms (the tiny_t2va audio VAE).

Why not diffusers' `AutoencoderOobleck`: even at toy width (hidden 16, ratios 2-4-4-5) it runs all
its dilated Snake residual units at the full sample rate, so a forward of a batch of one-second
clips on a CPU core is far outside the pretraining budget (minutes on one core).
This model keeps Oobleck's interface (`encode(x).latent_dist`, `decode(z).sample`, diffusers
`ModelMixin`/`ConfigMixin` save/load) but analyses the waveform with one learned strided filterbank
(window 2*hop, hop 160 = 10 ms) and does its work at the latent frame rate; the decoder mirrors it
with a learned overlap-add synthesis (transposed conv). Trained with waveform L1 + multi-resolution
STFT magnitude loss + a small KL term (scripts/pretrain_t2va.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


@dataclass
class EncoderOutput:
    latent_dist: DiagonalGaussianDistribution


@dataclass
class DecoderOutput:
    sample: torch.Tensor


class ResBlock1D(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.net = nn.Sequential(nn.SiLU(), nn.Conv1d(channels, channels, 3, padding=dilation,
                                                      dilation=dilation),
                                 nn.SiLU(), nn.Conv1d(channels, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class TinyAudioVAE(ModelMixin, ConfigMixin):
    """waveform (B, 1, N) <-> latent (B, latent_channels, N / hop)."""

    @register_to_config
    def __init__(self, audio_channels: int = 1, hop: int = 160, hidden: int = 64,
                 latent_channels: int = 8, num_res_blocks: int = 3, sampling_rate: int = 16000):
        super().__init__()
        pad = hop // 2
        self.analysis = nn.Conv1d(audio_channels, hidden, 2 * hop, stride=hop, padding=pad)
        self.encoder = nn.Sequential(*[ResBlock1D(hidden, 2 ** i) for i in range(num_res_blocks)],
                                     nn.SiLU(), nn.Conv1d(hidden, 2 * latent_channels, 1))
        self.decoder = nn.Sequential(nn.Conv1d(latent_channels, hidden, 3, padding=1),
                                     *[ResBlock1D(hidden, 2 ** i) for i in range(num_res_blocks)],
                                     nn.SiLU())
        self.synthesis = nn.ConvTranspose1d(hidden, audio_channels, 2 * hop, stride=hop,
                                            padding=pad)

    def encode(self, x: torch.Tensor) -> EncoderOutput:
        """x (B, 1, N) float, N a multiple of hop -> posterior over z (B, C, N / hop)."""
        moments = self.encoder(self.analysis(x))                        # (B, 2C, N/hop)
        return EncoderOutput(DiagonalGaussianDistribution(moments))

    def decode(self, z: torch.Tensor) -> DecoderOutput:
        """z (B, C, L) -> waveform (B, 1, L * hop)."""
        return DecoderOutput(self.synthesis(self.decoder(z)))
