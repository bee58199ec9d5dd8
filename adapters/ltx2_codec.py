"""LTX-2's sampler state, latent artifacts and decoders (diffusers 0.42.1, pipeline_ltx2.py).

Sampler state: one flat fp32 vector per row, the transformer's two token streams back to back,
in the space the transformer reads (normalised):

    [ video tokens (S + K) x Cv | audio tokens L x (Ca M') ]

    video tokens  the pipeline's packed video latents (B, S, Cv): (x - latents_mean) *
                  scaling_factor / latents_std per channel (:778-790), patchified p x p x pt into
                  S = F'/pt * h/p * w/p tokens of Cv = C pt p p (:630-651); F' = (F - 1) / 8 + 1,
                  h = H / 32, w = W / 32; then K appended keyframe tokens (a last-frame
                  condition, LTX2ConditionPipeline's `VideoConditionByKeyframeIndex`)
    audio tokens  the packed audio latents (B, L, Ca M') normalised per packed feature with the
                  audio VAE's latents_mean / latents_std (:824-835), L = round(F / fps * sr /
                  hop / 4) (:1306-1310)

Latent artifacts are exact reshapes of that state, so split(join(x)) == x bit for bit:
    video_latent  (B, C, F', h, w)  normalised (Layout.LATENT_CTHW); keyframe tokens dropped, as
                  the pipeline drops them (pipeline_ltx2_condition.py:2065-2066)
    audio_latent  (B, Ca, L, M')    normalised (Layout.LATENT_CLM)
`output_type="latent"` returns the same latents *denormalised* (`denormalize_video` /
`denormalize_audio` below give that form).

Decoders: video_latent -> vae (timestep 0 when the VAE is timestep-conditioned, the pipeline's
default decode_timestep) -> uint8 (B, F, 3, H, W); audio_latent -> audio_vae -> mel -> vocoder
-> float waveform (B, channels, samples) at the vocoder's `output_sampling_rate`, checked on
every decode against the samples the vocoder really produced per mel frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from adapters.family import (Codec, MediaCondition, check_condition_frame, check_latent_shape,
                             unit_to_uint8)
from contract import (InvalidRequestError, MediaRole, OutputContractError,
                      SamplingSpec)
from diffusion.guidance import STREAM_BOUNDS
from diffusion.step import FrozenLatents

LAYOUT = "ltx2_layout"                       # media input: (1, 4 + k) int64 [F', h, w, L, kf...]
CONDITION_MASK = "video_condition_mask"      # media input: (1, S + K) float, 1 = condition token


@dataclass(frozen=True)
class LTX2Dims:
    """Static sizes from the checkpoint's configs (no weights)."""

    spatial_ratio: int           # VAE spatial compression (32)
    temporal_ratio: int          # VAE temporal compression (8)
    patch: int                   # transformer patch_size
    patch_t: int                 # transformer patch_size_t
    latent_channels: int         # VAE latent channels C
    audio_channels: int          # audio VAE latent channels Ca
    latent_mel_bins: int         # M' = mel_bins / 4
    audio_rate: int              # audio VAE mel input sample rate
    hop: int                     # mel hop length
    audio_ratio: int             # audio VAE temporal compression (4, fixed in diffusers)
    frame_rate: float            # playback fps (RoPE uses frame_rate / motion_speed)
    output_rate: int             # vocoder output_sampling_rate (the declared audio rate)

    @property
    def video_features(self) -> int:
        return self.latent_channels * self.patch_t * self.patch * self.patch

    @property
    def audio_features(self) -> int:
        return self.audio_channels * self.latent_mel_bins


@dataclass(frozen=True)
class LTX2Layout:
    """One request's state: latent grid, audio length and appended keyframes."""

    dims: LTX2Dims
    frames: int                          # F' latent frames
    rows: int                            # h
    cols: int                            # w
    audio_length: int                    # L
    keyframes: tuple[int, ...] = ()      # pixel frame index of each appended keyframe

    @property
    def grid_tokens(self) -> int:        # tokens of one latent frame
        return (self.rows // self.dims.patch) * (self.cols // self.dims.patch)

    @property
    def video_tokens(self) -> int:       # S
        return self.frames // self.dims.patch_t * self.grid_tokens

    @property
    def keyframe_tokens(self) -> int:    # K (each keyframe is one latent frame)
        return len(self.keyframes) * self.grid_tokens

    @property
    def video_size(self) -> int:
        return (self.video_tokens + self.keyframe_tokens) * self.dims.video_features

    @property
    def audio_size(self) -> int:
        return self.audio_length * self.dims.audio_features

    @property
    def size(self) -> int:
        return self.video_size + self.audio_size

    def encoded(self) -> torch.Tensor:
        return torch.tensor([[self.frames, self.rows, self.cols, self.audio_length,
                              *self.keyframes]], dtype=torch.long)

    def bounds(self) -> torch.Tensor:
        return torch.tensor([[0, self.video_size, self.size]], dtype=torch.long)

    # ---- state <-> token streams -------------------------------------------------------------
    def tokens(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) -> video tokens (B, S + K, Cv), audio tokens (B, L, Ca M')."""
        if state.ndim != 2 or state.shape[1] != self.size:
            raise InvalidRequestError("the LTX-2 state does not match its layout", field="state",
                                      expected=("B", self.size), actual=tuple(state.shape))
        b = state.shape[0]
        return (state[:, :self.video_size].reshape(b, -1, self.dims.video_features),
                state[:, self.video_size:].reshape(b, self.audio_length,
                                                   self.dims.audio_features))

    @staticmethod
    def state(video_tokens: torch.Tensor, audio_tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([video_tokens.flatten(1), audio_tokens.flatten(1)], dim=1)

    def pack_video(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, C, F', h, w) -> (B, S, Cv): patches of pt x p x p, frame-major token order."""
        d, (b, c, f, h, w) = self.dims, latent.shape
        x = latent.reshape(b, c, f // d.patch_t, d.patch_t, h // d.patch, d.patch,
                           w // d.patch, d.patch)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * d.patch_t * d.patch ** 2)

    def unpack_video(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S, Cv) -> (B, C, F', h, w), the inverse of pack_video."""
        d, b = self.dims, tokens.shape[0]
        x = tokens.reshape(b, self.frames // d.patch_t, self.rows // d.patch,
                           self.cols // d.patch, d.latent_channels, d.patch_t, d.patch, d.patch)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
            b, d.latent_channels, self.frames, self.rows, self.cols)

    def pack_audio(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, Ca, L, M') -> (B, L, Ca M')."""
        return latent.transpose(1, 2).flatten(2, 3)

    def unpack_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L, Ca M') -> (B, Ca, L, M')."""
        return tokens.unflatten(2, (self.dims.audio_channels, -1)).transpose(1, 2)


class LTX2Codec(Codec):
    """image_crf: H.264 CRF condition frames are re-compressed at before encoding, as the
    conditioned pipelines do by default (0 = none)."""

    def __init__(self, dims: LTX2Dims, image_crf: int = 0):
        self.dims, self.image_crf = dims, image_crf

    # ---- sizes ----------------------------------------------------------------------------
    def layout(self, sampling: SamplingSpec, keyframes: Sequence[int] = ()) -> LTX2Layout:
        d = self.dims
        multiple = d.spatial_ratio * d.patch
        for name in ("height", "width"):
            value = getattr(sampling, name)
            if value % multiple:
                raise InvalidRequestError(f"LTX-2 generates sizes divisible by {multiple} (VAE "
                                          "x patch); nothing is resized", field=f"sampling.{name}",
                                          expected=f"a multiple of {multiple}", actual=value)
        f = sampling.num_frames
        frames = (f - 1) // d.temporal_ratio + 1
        if (f - 1) % d.temporal_ratio or frames % d.patch_t:
            raise InvalidRequestError(f"the LTX-2 VAE produces {d.temporal_ratio}n + 1 frames "
                                      "(another count would decode to fewer frames than the "
                                      "audio is sized for)", field="sampling.num_frames",
                                      expected=f"{d.temporal_ratio}n + 1", actual=f)
        per_second = d.audio_rate / d.hop / d.audio_ratio
        audio_length = round(f / d.frame_rate * per_second)
        if audio_length < 1:
            raise InvalidRequestError("the clip is too short for one audio latent frame",
                                      field="sampling.num_frames", actual=f)
        return LTX2Layout(d, frames, sampling.height // d.spatial_ratio,
                          sampling.width // d.spatial_ratio, audio_length, tuple(keyframes))

    def layout_of(self, media: Mapping[str, torch.Tensor] | None) -> LTX2Layout:
        """The layout the rows of one forward share (media input LAYOUT)."""
        encoded = (media or {}).get(LAYOUT)
        if encoded is None:
            raise InvalidRequestError("the LTX-2 forward needs its layout input", field=LAYOUT,
                                      expected="(B, 4 + keyframes) int64", actual=None)
        if not bool((encoded == encoded[:1]).all()):
            raise InvalidRequestError("rows of one forward must share their layout",
                                      field=LAYOUT, actual=encoded.tolist())
        f, h, w, length, *keyframes = (int(v) for v in encoded[0].tolist())
        return LTX2Layout(self.dims, f, h, w, length, tuple(keyframes))

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        return (self.layout(sampling).size,)

    def split_state(self, state, sampling):
        base = self.layout(sampling)
        extra = state.shape[1] - base.size
        grid = base.grid_tokens * self.dims.video_features
        if state.ndim != 2 or extra < 0 or extra % grid:
            raise InvalidRequestError("the LTX-2 state does not match the sampling size",
                                      field="state", expected=("B", f"{base.size} + k * {grid}"),
                                      actual=tuple(state.shape))
        layout = LTX2Layout(self.dims, base.frames, base.rows, base.cols, base.audio_length,
                            (0,) * (extra // grid))
        video, audio = layout.tokens(state)
        return {"video_latent": layout.unpack_video(video[:, :layout.video_tokens]),
                "audio_latent": layout.unpack_audio(audio)}

    def join_state(self, latents, sampling):
        layout = self.layout(sampling)
        return layout.state(layout.pack_video(latents["video_latent"].float()),
                            layout.pack_audio(latents["audio_latent"].float()))

    def condition_state(self, state: torch.Tensor, sampling: SamplingSpec,
                        media: MediaCondition) -> torch.Tensor:
        """A state joined from the latent artifacts -> the request's state with its keyframe
        tokens (held values) inserted after the video tokens."""
        if media.state_shape is None:
            return state
        base = self.layout(sampling)
        video, audio = base.tokens(state)
        full = self.layout(sampling, self._keyframes(media))
        held = full.tokens(media.frozen.values.expand(state.shape[0], -1).to(state))[0]
        return full.state(torch.cat([video, held[:, base.video_tokens:]], dim=1), audio)

    @staticmethod
    def _keyframes(media: MediaCondition) -> tuple[int, ...]:
        return tuple(int(v) for v in media.inputs[LAYOUT][0, 4:].tolist())

    # ---- normalisation (with the loaded VAEs' statistics) ----------------------------------
    def denormalize_video(self, vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """Normalised (B, C, F', h, w) -> the VAE's latent space (the pipeline's latent output)."""
        mean, std = _stats(vae, latent, (1, -1, 1, 1, 1))
        return latent * std / float(vae.config.scaling_factor) + mean

    def normalize_condition(self, vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """A condition frame's VAE latent -> state space. Both conditioned pipelines normalise
        their condition latents without the scaling factor (pipeline_ltx2_image2video.py:846,
        pipeline_ltx2_condition.py:1153-1155), unlike the noise latents."""
        mean, std = _stats(vae, latent, (1, -1, 1, 1, 1))
        return (latent - mean) / std

    def denormalize_audio(self, audio_vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """Normalised (B, Ca, L, M') -> the audio VAE's latent space (per packed feature)."""
        packed = latent.transpose(1, 2).flatten(2, 3)                            # (B, L, Ca M')
        mean, std = _stats(audio_vae, packed, (1, 1, -1))
        return (packed * std + mean).unflatten(2, (latent.shape[1], -1)).transpose(1, 2)

    # ---- decoding ---------------------------------------------------------------------------
    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec) -> torch.Tensor:
        layout = self.layout(sampling)
        with torch.no_grad():
            if latent_name == "video_latent":
                want = (self.dims.latent_channels, layout.frames, layout.rows, layout.cols)
                check_latent_shape(latent, want, latent_name)
                return self.decode_video(modules["vae"], latent.float(), sampling.num_frames)
            if latent_name == "audio_latent":
                want = (self.dims.audio_channels, layout.audio_length, self.dims.latent_mel_bins)
                check_latent_shape(latent, want, latent_name)
                return self.decode_audio(modules["audio_vae"], modules["vocoder"], latent.float())
        raise InvalidRequestError("LTX-2 decodes video_latent / audio_latent",
                                  field="latent_name", expected=["video_latent", "audio_latent"],
                                  actual=latent_name)

    def decode_video(self, vae: nn.Module, latent: torch.Tensor, num_frames: int) -> torch.Tensor:
        """-> uint8 (B, F, 3, H, W) as VideoProcessor.postprocess_video maps [-1, 1]."""
        param = next(vae.parameters())
        z = self.denormalize_video(vae, latent).to(param.device, param.dtype)
        timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype) \
            if vae.config.timestep_conditioning else None          # decode_timestep 0, no noise
        video = vae.decode(z, timestep, return_dict=False)[0].float()            # (B, 3, F, H, W)
        if video.shape[2] != num_frames:
            raise OutputContractError("the video VAE decoded another frame count",
                                      field="artifacts.video", expected=num_frames,
                                      actual=int(video.shape[2]))
        return unit_to_uint8(video).permute(0, 2, 1, 3, 4).cpu()

    def decode_audio(self, audio_vae: nn.Module, vocoder: nn.Module,
                     latent: torch.Tensor) -> torch.Tensor:
        """-> float waveform (B, channels, samples) at the declared rate, checked."""
        param = next(audio_vae.parameters())
        z = self.denormalize_audio(audio_vae, latent).to(param.device, param.dtype)
        mel = audio_vae.decode(z, return_dict=False)[0]                       # (B, c, T, mels)
        wave = vocoder(mel.to(next(vocoder.parameters()).dtype)).float()
        self.check_rate(vocoder, int(mel.shape[2]), int(wave.shape[-1]))
        return wave.cpu()

    def check_rate(self, vocoder: nn.Module, mel_frames: int, samples: int) -> None:
        """The waveform is at the declared rate: the vocoder says so, and it made
        declared_rate * hop / mel_rate samples per mel frame."""
        declared = self.dims.output_rate
        said = int(vocoder.config.output_sampling_rate)
        produced = samples * self.dims.audio_rate / (self.dims.hop * mel_frames)
        if said != declared or abs(produced - declared) > 1e-6 * declared:
            raise OutputContractError("decoded audio is not at the declared sample rate",
                                      field="artifacts.audio.sample_rate", expected=declared,
                                      actual={"vocoder_config": said, "produced": produced})

    # ---- condition frames ------------------------------------------------------------------
    def frame_latent(self, vae: nn.Module, frame: torch.Tensor, sampling: SamplingSpec,
                     role: MediaRole, crf: int) -> torch.Tensor:
        """uint8 (3, H, W) at the request size -> normalised latent (1, C, 1, h, w) (the
        posterior mode, as both conditioned pipelines take it)."""
        check_condition_frame(frame, sampling.height, sampling.width, f"media.{role.value}")
        if crf:
            from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
            hwc = apply_image_conditioning_crf(frame.permute(1, 2, 0).contiguous().numpy(), crf)
            frame = torch.from_numpy(hwc).permute(2, 0, 1)
        param = next(vae.parameters())
        pixels = (frame.float() / 127.5 - 1.0)[None, :, None].to(param.device, param.dtype)
        with torch.no_grad():
            z = vae.encode(pixels).latent_dist.mode().float()
        return self.normalize_condition(vae, z).cpu()

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        roles = set(media)
        if roles - {MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME} or \
                (MediaRole.LAST_FRAME in roles and MediaRole.FIRST_FRAME not in roles):
            raise InvalidRequestError("LTX-2 takes a first frame, or a first and a last frame",
                                      field="media", expected=["first_frame", "last_frame"],
                                      actual=sorted(r.value for r in roles))
        base = self.layout(sampling)
        if not media:
            return MediaCondition(inputs={LAYOUT: base.encoded(), STREAM_BOUNDS: base.bounds()},
                                  key=tuple(base.encoded()[0].tolist()))
        if "vae" not in modules:
            raise InvalidRequestError("condition frames need the video VAE's encoder",
                                      field="media_modules", expected=["vae"],
                                      actual=sorted(modules))
        keyframes: tuple[int, ...] = ()
        if MediaRole.LAST_FRAME in roles:
            if base.frames < 2:
                raise InvalidRequestError("a last-frame condition needs at least two latent "
                                          "frames", field="sampling.num_frames",
                                          expected=f">= {self.dims.temporal_ratio + 1}",
                                          actual=sampling.num_frames)
            # latent index F' - 1 (LTX2VideoCondition index=-1) sits at pixel frame
            # (index - 1) * 8 + 1 (pipeline_ltx2_condition.py:1192)
            keyframes = ((base.frames - 2) * self.dims.temporal_ratio + 1,)
        layout = self.layout(sampling, keyframes)
        crf = self.image_crf
        first = layout.pack_video(self.frame_latent(modules["vae"], media[MediaRole.FIRST_FRAME],
                                                    sampling, MediaRole.FIRST_FRAME, crf))
        video = torch.zeros(1, layout.video_tokens + layout.keyframe_tokens,
                            self.dims.video_features)
        held = torch.zeros(video.shape[:2], dtype=torch.bool)
        video[:, :layout.grid_tokens], held[:, :layout.grid_tokens] = first, True
        if keyframes:
            last = layout.pack_video(self.frame_latent(modules["vae"],
                                                       media[MediaRole.LAST_FRAME], sampling,
                                                       MediaRole.LAST_FRAME, crf))
            video[:, layout.video_tokens:], held[:, layout.video_tokens:] = last, True
        audio = torch.zeros(1, layout.audio_length, self.dims.audio_features)
        mask = layout.state(held[..., None].expand(video.shape), audio.bool())
        return MediaCondition(
            frozen=FrozenLatents(mask, layout.state(video, audio)),
            inputs={LAYOUT: layout.encoded(), STREAM_BOUNDS: layout.bounds(),
                    CONDITION_MASK: held.float()},
            key=tuple(layout.encoded()[0].tolist()),
            state_shape=None if not keyframes else (layout.size,))


def _stats(vae: nn.Module, like: torch.Tensor, shape: tuple[int, ...]):
    return (vae.latents_mean.view(shape).to(like.device, like.dtype),
            vae.latents_std.view(shape).to(like.device, like.dtype))
