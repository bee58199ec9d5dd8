"""The toy joint audio-video DiT of the tiny_t2va adapter.

One transformer over a packed in-context sequence [text tokens | video latent tokens | audio latent
tokens] with shared full attention. Each token gets a learned modality embedding (text / video /
audio), a learned position (text index; video frame + patch; audio patch) and, for video tokens,
an 'is condition' embedding (FL2VA first/last frames are clean, frozen conditions). Time enters
through adaLN-Zero modulation (Peebles & Xie 2023, DiT section 3.2). Built from diffusers blocks:
`Attention` (separate to_q/to_k/to_v, fusable) and `FeedForward` (fc1 = `net.0.proj`).

The network reads DATA-PROGRESS time (0 = noise, 1000 = data) and predicts the velocity toward the
data, x0 - eps. It never converts time itself: `diffusion.conventions` does that for the sampler.
"""
from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

TEXT, VIDEO, AUDIO = 0, 1, 2


class AVBlock(nn.Module):
    """adaLN-Zero transformer block: x += g1 * Attn(mod(LN x)); x += g2 * FF(mod(LN x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(query_dim=dim, heads=heads, dim_head=dim // heads, bias=True,
                              out_bias=True, processor=AttnProcessor2_0())
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, mult=4, activation_fn="gelu-approximate")
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # x (B, N, D); temb (B, D); bias (B, 1, N) additive key mask
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(nn.functional.silu(temb))[:, None].chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, attention_mask=bias)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.ff(h)


class TinyAVTransformer(ModelMixin, ConfigMixin):
    """video latent (B, Cv, T, h, w) + audio latent (B, Ca, L) + text (B, Lt, Dt) -> same shapes."""

    @register_to_config
    def __init__(self, video_channels: int = 4, num_frames: int = 8, latent_size: int = 8,
                 patch_size: int = 2, audio_channels: int = 8, audio_length: int = 100,
                 audio_patch: int = 4, text_dim: int = 384, max_text_tokens: int = 24,
                 dim: int = 96, heads: int = 4, num_layers: int = 4):
        super().__init__()
        p, side = patch_size, latent_size // patch_size
        self.video_in = nn.Linear(video_channels * p * p, dim)
        self.audio_in = nn.Linear(audio_channels * audio_patch, dim)
        self.text_in = nn.Linear(text_dim, dim)
        self.modality = nn.Embedding(3, dim)
        self.is_condition = nn.Embedding(2, dim)
        self.frame_pos = nn.Parameter(torch.randn(num_frames, 1, dim) * 0.02)
        self.patch_pos = nn.Parameter(torch.randn(1, side * side, dim) * 0.02)
        self.audio_pos = nn.Parameter(torch.randn(audio_length // audio_patch, dim) * 0.02)
        self.text_pos = nn.Parameter(torch.randn(max_text_tokens, dim) * 0.02)
        self.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(256, dim)
        self.blocks = nn.ModuleList(AVBlock(dim, heads) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(dim, 2 * dim)
        self.video_out = nn.Linear(dim, video_channels * p * p)
        self.audio_out = nn.Linear(dim, audio_channels * audio_patch)
        for layer in (self.ada_out, self.video_out, self.audio_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # (B, C, T, h, w) <-> (B, T*(h/p)*(w/p), C*p*p)
    def _patchify_video(self, v: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = v.shape
        p = self.config.patch_size
        v = v.reshape(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        return v.reshape(b, t * (h // p) * (w // p), c * p * p)

    def _unpatchify_video(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        p, side, c = cfg.patch_size, cfg.latent_size // cfg.patch_size, cfg.video_channels
        b = x.shape[0]
        x = x.reshape(b, cfg.num_frames, side, side, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(b, c, cfg.num_frames, side * p, side * p)

    # (B, C, L) <-> (B, L/q, C*q)
    def _patchify_audio(self, a: torch.Tensor) -> torch.Tensor:
        b, c, length = a.shape
        q = self.config.audio_patch
        return a.reshape(b, c, length // q, q).permute(0, 2, 1, 3).reshape(b, length // q, c * q)

    def _unpatchify_audio(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, n, _ = x.shape
        q, c = cfg.audio_patch, cfg.audio_channels
        return x.reshape(b, n, c, q).permute(0, 2, 1, 3).reshape(b, c, n * q)

    def forward(self, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                text: torch.Tensor, text_mask: torch.Tensor,
                condition_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """video (B,Cv,T,h,w); audio (B,Ca,L); timestep (B,) data-progress model time;
        text (B,Lt,Dt); text_mask (B,Lt) bool; condition_frames (B,T) bool.
        Returns the data-directed velocity (x0 - eps) for video and audio, same shapes."""
        cfg = self.config
        b, lt = text.shape[0], text.shape[1]
        side = cfg.latent_size // cfg.patch_size
        per_frame = side * side
        vt = self.video_in(self._patchify_video(video))                          # (B, Nv, D)
        vt = vt + (self.frame_pos + self.patch_pos).reshape(1, -1, vt.shape[-1])
        cflag = condition_frames.long().repeat_interleave(per_frame, dim=1)      # (B, Nv)
        vt = vt + self.modality.weight[VIDEO] + self.is_condition(cflag)
        at = self.audio_in(self._patchify_audio(audio)) + self.audio_pos + self.modality.weight[AUDIO]
        tt = self.text_in(text) + self.text_pos[:lt] + self.modality.weight[TEXT]  # (B, Lt, D)
        x = torch.cat([tt, vt, at], dim=1)                                        # (B, N, D)
        keep = torch.cat([text_mask.bool(), torch.ones(b, vt.shape[1] + at.shape[1],
                                                       dtype=torch.bool, device=x.device)], 1)
        bias = torch.zeros(b, 1, x.shape[1], dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~keep[:, None, :], torch.finfo(x.dtype).min)      # (B, 1, N)
        temb = self.time_embed(self.time_proj(timestep.to(x.dtype)).to(x.dtype))  # (B, D)
        for block in self.blocks:
            x = block(x, temb, bias)
        shift, scale = self.ada_out(nn.functional.silu(temb))[:, None].chunk(2, -1)
        x = self.norm_out(x) * (1 + scale) + shift
        nv = vt.shape[1]
        v_out = self._unpatchify_video(self.video_out(x[:, lt:lt + nv]))
        a_out = self._unpatchify_audio(self.audio_out(x[:, lt + nv:]))
        return v_out, a_out
