"""MiniMax-H3 (diffusers 0.42.1 modular pipeline, modular_pipelines/minimax_h3/): T2VA, I2VA / L2VA /
FL2VA (a first, a last or both keyframes), REF2VA with ordered image references (option `ref2va`,
which loads `transformer_ref` beside `transformer`).

One packed sequence per request, `[text | keyframe rows | audio rows | video rows]`, one
transformer forward per step for both streams, guidance-distilled (no CFG, no negative prompt:
denoise.py:54-57, modular_pipeline.py class docstring). The layout and the per-row timesteps are
the pipeline's own static builders (MiniMaxH3PrepareLayoutStep.build_packed_sequence,
MiniMaxH3SetTimestepsStep.build_row_timesteps), called here, not copied.

Sampler state (B, N) fp32, the rows the pipeline's loop writes, back to back:

    [ generated video rows S x Cv | audio rows 2L x Ca ]

    video rows  patchify_video_latents of the (normalised) video latent (1, C, F', h, w): frame-
                major rows of C * pt * ph * pw; F' = 5 n + 2 for 17 n + 5 frames, h = H / 16
    audio rows  channel-major stereo rows (2 L, Ca), L = round(F / 24 * 40)

Two schedules (scheduling_minimax_h3.py: video shift 12, audio shift 3, both over
linspace(1, 0, steps + 1)). The project's sigma is the video sigma. At step i of the request's
table the denoiser calls the audio rows at the audio table's timestep and scales their
velocity by (sa_i - sa_i+1) / (s_i - s_i+1), so one Euler step in s moves the audio rows
exactly as the audio scheduler's step does; at a sigma off the table (training noise levels)
the same coupling in continuous time, sa = g(s), velocity scale g'(s). Both velocities carry
the scheduler's x0 arithmetic: its sigma comes from the timestep (1 - (1 - sigma) in fp32).

FL2VA: each keyframe (first and / or last) is encoded as the pipeline encodes it
(encode_vae_condition: ImageNet-normalised pixels, the posterior sampled under seed 42, fp16
round trip, normalised), noised to t = 0.999 with noise the row's own seed draws first (the
pipeline's generator order), and rides in front of the generated rows as a model input (never
written: the loop writes the generated rows only). The keyframes' vision blocks in the
Qwen3-VL presentation are the conditioner's (`Qwen3VLConditioner.encode_with_media`, which the
encoder stage runs with the prompt: `media_roles`). ref2va: image references at the size the
pipeline encodes them, the same recipe in request order, on the `transformer_ref` partition.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.checkpoint import read_json
from adapters.diffusers_parts import QWEN_VL_ETP_PLAN, TokenizingConditioner, encoder_vocab_size
from adapters.family import (CheckpointFamily, Codec, EncoderSpec, FamilySpec,
                             MediaCondition, Overflow, check_latent_shape, request_errors)
from contract import (ArtifactSpec, Condition, ConfigError, GuidanceKind, InvalidRequestError,
                      IOSpec, Layout, LimitExceededError, MediaFormatError, MediaRole, Modality,
                      PromptBundle, Representation, RequestLimits, RolloutRequest, SamplingSpec,
                      Task, TimeConvention)
from diffusion.guidance import GuidanceRule

QWEN3_VL = "qwen3_vl"                       # the encoder's name (keys its ids in a PromptBundle)
TEXT_ENCODER = "text_encoder"
FPS = 24                                    # modular_pipeline.py MINIMAX_H3_FPS
AUDIO_LATENTS_PER_SECOND = 40               # MINIMAX_H3_AUDIO_LATENTS_PER_SECOND
AUDIO_CHANNELS = 2                          # stereo, channel-major rows
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0        # MiniMaxH3ModularPipeline.min/max_duration
TEXT_LAYER = 50                             # MiniMaxH3ModularPipeline.text_encoder_layer
KEYFRAME_NOISE_AUG = 0.999                  # .keyframe_noise_aug
KEYFRAME_ENCODE_SEED = 42                   # .keyframe_encode_seed
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2    # MINIMAX_H3_*_TAG

LAYOUT = "minimax_h3_layout"        # media input (1, 5) int64 [F', h, w, L, steps]
KEYFRAME_ROWS = "minimax_h3_keyframe_rows"     # media input (B, K, Cv) fp32, noised anchors
KEYFRAME_ANCHORS = "minimax_h3_keyframe_anchors"   # media input (1, K') int64, 0 first / 1 last
REFERENCE_GEOMETRY = "minimax_h3_reference_geometry"  # media input (1, n, 3) int64 [f', h, w]
MAX_IMAGE_REFERENCES = 9                    # MiniMaxH3Ref2VASetupStep max_images

# every attention projection and both SwiGLU linears of the joint blocks (no cross-attention)
MINIMAX_H3_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")

# Qwen3-VL's language model split as every Qwen-VL's; q_norm / k_norm act per head and stay
# whole. The vision tower is replicated: its attention projects q, k and v with one fused `qkv`
# linear, which a column split would cut across the three instead of across heads, and it runs
# only on keyframe pixels (a few hundred tokens).
QWEN3_VL_ETP_PLAN = QWEN_VL_ETP_PLAN


class MiniMaxH3Options(BaseModel):
    """Settings of a MiniMax-H3 deployment (config `rollout.adapter_options`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(512, ge=1, le=8192, description="Qwen3-VL ids per prompt "
                                     "(the pipeline has no window: longer prompts are refused).")
    reference_image_short_edge: int = Field(2048, ge=32, le=4096, description="The short edge "
                                            "ref2va encodes an image reference at (the pipeline's "
                                            "config; references of another size are refused).")
    ref2va: bool = Field(False, description="Serve the ref2va task: load `transformer_ref` (the "
                         "pipeline's ref2va transformer, its own weights) beside `transformer`.")


def shifted(base: torch.Tensor | float, shift: float):
    """The scheduler's exponential shift s b / (1 + (s - 1) b)."""
    return shift * base / (1 + (shift - 1) * base)


class MiniMaxH3Schedules:
    """The two MiniMaxH3Scheduler configs (video `scheduler`, audio `audio_scheduler`)."""

    def __init__(self, root: Path):
        self.shifts = {}
        for name in ("scheduler", "audio_scheduler"):
            config = read_json(root, name, "scheduler_config.json")
            if config.get("_class_name") != "MiniMaxH3Scheduler":
                raise ConfigError("MiniMax-H3 samples with its MiniMaxH3Scheduler configs",
                                  field=name, expected="MiniMaxH3Scheduler",
                                  actual=config.get("_class_name"))
            self.shifts[name] = float(config.get("shift", 12.0 if name == "scheduler" else 3.0))

    def scheduler(self, name: str, num_steps: int):
        from diffusers import MiniMaxH3Scheduler
        scheduler = MiniMaxH3Scheduler(shift=self.shifts[name])
        scheduler.set_timesteps(num_steps + 1)          # steps + 1 grid points, terminal 0
        return scheduler

    def tables(self, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(video sigmas, audio sigmas), (num_steps + 1,) fp32 each, as set_timesteps builds
        them; a step count whose shifted grid collapses (unique_consecutive) is refused."""
        out = []
        for name in ("scheduler", "audio_scheduler"):
            sigmas = self.scheduler(name, num_steps).sigmas.float().cpu()
            if sigmas.shape[0] != num_steps + 1:
                raise InvalidRequestError("the shifted schedule collapses steps at this count",
                                          field="sampling.num_steps",
                                          expected=f"a count with {num_steps + 1} distinct "
                                          "sigmas", actual=num_steps)
            out.append(sigmas)
        return out[0], out[1]

    def audio_sigma(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sa, dsa / ds) of the continuous coupling sa = g(s) through the shared base grid."""
        sv, sa = self.shifts["scheduler"], self.shifts["audio_scheduler"]
        s = sigma.double()
        base = s / (sv - (sv - 1) * s)
        audio = shifted(base, sa)
        dbase = sv / (sv - (sv - 1) * s) ** 2
        daudio = sa / (1 + (sa - 1) * base) ** 2
        return audio.float(), (daudio * dbase).float()


class MiniMaxH3Dims:
    """Static sizes from the checkpoint's configs (no weights)."""

    def __init__(self, root: Path):
        vae = read_json(root, "vae", "config.json")
        audio = read_json(root, "audio_vae", "config.json")
        transformer = read_json(root, "transformer", "config.json")
        self.spatial_ratio = int(math.prod(vae.get("spatial_downsample_factors", (2, 2, 2, 2))))
        temporal = int(math.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1))))
        self.frames_per_chunk = int(vae.get("clip_length", 17))
        self.latents_per_chunk = math.ceil(self.frames_per_chunk / temporal)
        self.latent_channels = int(vae.get("latent_channels", 24))
        self.audio_channels = int(audio.get("latent_channels", 32))
        self.sample_rate = int(audio.get("sampling_rate", 32000))
        hop = int(math.prod(audio.get("encoder_rates", (2, 4, 4, 5, 5))))
        self.patch = tuple(int(p) for p in transformer.get("patch_size", (1, 2, 2)))
        if self.sample_rate / hop != AUDIO_LATENTS_PER_SECOND:
            raise ConfigError("the pipeline sizes audio at 40 latents per second",
                              field="weights_path.audio_vae.encoder_rates",
                              expected=f"sampling_rate / hop = {AUDIO_LATENTS_PER_SECOND}",
                              actual=self.sample_rate / hop)
        for name, want, got in (
                ("transformer.in_channels", self.latent_channels, transformer.get("in_channels")),
                ("transformer.audio_in_channels", self.audio_channels,
                 transformer.get("audio_in_channels"))):
            if got != want:
                raise ConfigError("the transformer's input width does not match the VAEs",
                                  field=f"weights_path.{name}", expected=want, actual=got)

    @property
    def video_features(self) -> int:
        return self.latent_channels * math.prod(self.patch)

    @property
    def canvas_multiple(self) -> int:
        return self.spatial_ratio * self.patch[2]


class MiniMaxH3Layout:
    """One request's sizes: latent frames F', latent h / w, audio latents L per channel."""

    def __init__(self, dims: MiniMaxH3Dims, frames: int, rows: int, cols: int, audio: int,
                 num_steps: int):
        self.dims, self.frames, self.rows, self.cols, self.audio = dims, frames, rows, cols, audio
        self.num_steps = num_steps

    @property
    def rows_per_frame(self) -> int:
        pt, ph, pw = self.dims.patch
        return (self.rows // ph) * (self.cols // pw)

    @property
    def video_rows(self) -> int:
        return self.frames // self.dims.patch[0] * self.rows_per_frame

    @property
    def audio_rows(self) -> int:
        return self.audio * AUDIO_CHANNELS

    @property
    def video_size(self) -> int:
        return self.video_rows * self.dims.video_features

    @property
    def size(self) -> int:
        return self.video_size + self.audio_rows * self.dims.audio_channels

    def encoded(self) -> torch.Tensor:
        return torch.tensor([[self.frames, self.rows, self.cols, self.audio, self.num_steps]],
                            dtype=torch.long)

    def tokens(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) -> video rows (B, S, Cv), audio rows (B, 2L, Ca)."""
        if state.ndim != 2 or state.shape[1] != self.size:
            raise InvalidRequestError("the MiniMax-H3 state does not match its layout",
                                      field="state", expected=("B", self.size),
                                      actual=tuple(state.shape))
        b = state.shape[0]
        return (state[:, :self.video_size].reshape(b, self.video_rows, -1),
                state[:, self.video_size:].reshape(b, self.audio_rows, -1))

    @staticmethod
    def state(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def pack_video(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, C, F', h, w) -> (B, S, Cv): patchify_video_latents per row."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
        return torch.stack([patchify_video_latents(x[None], self.dims.patch) for x in latent])

    def unpack_video(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, S, Cv) -> (B, C, F', h, w), as MiniMaxH3AfterDenoiseStep unpacks (decoders.py)."""
        (pt, ph, pw), c, b = self.dims.patch, self.dims.latent_channels, rows.shape[0]
        x = rows.reshape(b, self.frames // pt, self.rows // ph, self.cols // pw, c, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, self.frames, self.rows, self.cols)


class MiniMaxH3Codec(Codec):
    """Latent artifacts: video_latent (B, C, F', h, w) normalised (the pipeline's `latents`
    after the loop), audio_latent (B, 2L, Ca) the channel-major audio rows (Layout.TOKENS)."""

    def __init__(self, dims: MiniMaxH3Dims, reference_short_edge: int = 2048):
        self.dims = dims
        self.reference_short_edge = reference_short_edge

    def layout(self, sampling: SamplingSpec) -> MiniMaxH3Layout:
        d = self.dims
        for name in ("height", "width"):
            value = getattr(sampling, name)
            if value % d.canvas_multiple:
                raise InvalidRequestError(f"MiniMax-H3 generates sizes divisible by "
                                          f"{d.canvas_multiple} (VAE x patch); nothing is resized",
                                          field=f"sampling.{name}",
                                          expected=f"a multiple of {d.canvas_multiple}",
                                          actual=value)
        ratio = sampling.width / sampling.height
        if not 0.25 <= ratio <= 4:
            raise InvalidRequestError("MiniMax-H3 generates aspect ratios from 1:4 to 4:1",
                                      field="sampling.width", expected="1/4 <= W / H <= 4",
                                      actual=f"{sampling.width} / {sampling.height}")
        f = sampling.num_frames
        if f % d.frames_per_chunk != d.latents_per_chunk:     # the pipeline would snap it up
            raise InvalidRequestError(f"the MiniMax-H3 VAE decodes {d.frames_per_chunk} n + "
                                      f"{d.latents_per_chunk} frames; nothing is rounded",
                                      field="sampling.num_frames",
                                      expected=f"{d.frames_per_chunk} n + {d.latents_per_chunk}",
                                      actual=f)
        if not MIN_SECONDS <= f / FPS <= MAX_SECONDS:
            raise InvalidRequestError("MiniMax-H3 generates 5 to 15 seconds at 24 fps",
                                      field="sampling.num_frames",
                                      expected=f"[{int(MIN_SECONDS * FPS)}, "
                                      f"{int(MAX_SECONDS * FPS)}]", actual=f)
        frames = (f - d.latents_per_chunk) // d.frames_per_chunk * d.latents_per_chunk + 2
        audio = int(round(f / FPS * AUDIO_LATENTS_PER_SECOND))
        return MiniMaxH3Layout(d, frames, sampling.height // d.spatial_ratio,
                               sampling.width // d.spatial_ratio, audio, sampling.num_steps)

    def layout_of(self, media: Mapping[str, torch.Tensor] | None) -> MiniMaxH3Layout:
        encoded = (media or {}).get(LAYOUT)
        if encoded is None:
            raise InvalidRequestError("the MiniMax-H3 forward needs its layout input",
                                      field=LAYOUT, expected="(B, 5) int64", actual=None)
        if not bool((encoded == encoded[:1]).all()):
            raise InvalidRequestError("rows of one forward must share their layout",
                                      field=LAYOUT, actual=encoded.tolist())
        return MiniMaxH3Layout(self.dims, *(int(v) for v in encoded[0].tolist()))

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        return (self.layout(sampling).size,)

    def split_state(self, state, sampling):
        layout = self.layout(sampling)
        video, audio = layout.tokens(state)
        return {"video_latent": layout.unpack_video(video), "audio_latent": audio}

    def join_state(self, latents, sampling):
        layout = self.layout(sampling)
        return layout.state(layout.pack_video(latents["video_latent"].float()),
                            latents["audio_latent"].float())

    # ---- decoding (decoders.py MiniMaxH3VideoDecodeStep / MiniMaxH3AudioDecodeStep) ------
    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec) -> torch.Tensor:
        layout = self.layout(sampling)
        with torch.no_grad():
            if latent_name == "video_latent":
                check_latent_shape(latent, (self.dims.latent_channels, layout.frames,
                                            layout.rows, layout.cols), latent_name)
                return self.decode_video(modules["vae"], latent.float())
            if latent_name == "audio_latent":
                check_latent_shape(latent, (layout.audio_rows, self.dims.audio_channels),
                                   latent_name)
                return self.decode_audio(modules["audio_vae"], latent.float(), layout.audio)
        raise InvalidRequestError("MiniMax-H3 decodes video_latent / audio_latent",
                                  field="latent_name", expected=["video_latent", "audio_latent"],
                                  actual=latent_name)

    @staticmethod
    def decode_video(vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """-> uint8 (B, F, 3, H, W): denormalised, decoded, ImageNet pixel convention reverted,
        [0, 1] -> round(x * 255) as VideoProcessor's pil / uint8 output does."""
        param = next(vae.parameters())
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latent)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latent)
        out = []
        for row in latent * std + mean:                   # the pipeline decodes one request
            video = vae.decode(row[None].to(param.device, param.dtype), return_dict=False)[0]
            pm = torch.tensor(PIXEL_MEAN, device=video.device).view(1, -1, 1, 1, 1)
            ps = torch.tensor(PIXEL_STD, device=video.device).view(1, -1, 1, 1, 1)
            unit = (video.float() * ps + pm).clamp(0, 1)
            out.append((unit * 255).round().to(torch.uint8)[0].permute(1, 0, 2, 3).cpu())
        return torch.stack(out)

    @staticmethod
    def decode_audio(audio_vae: nn.Module, rows: torch.Tensor, length: int) -> torch.Tensor:
        """(B, 2L, Ca) rows -> float waveform (B, 2, samples) at the audio VAE's rate."""
        param = next(audio_vae.parameters())
        mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
        std = torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)
        out = []
        for row in rows:
            latent = row.reshape(AUDIO_CHANNELS, length, -1).permute(0, 2, 1)   # (2, Ca, L)
            latent = latent * std.to(latent) + mean.to(latent)
            audio = audio_vae.decode(latent.to(param.device, param.dtype), return_dict=False)[0]
            out.append(audio.float().permute(1, 0, 2)[0].cpu())               # (2, samples)
        return torch.stack(out)

    # ---- condition media (FL2VA keyframes) ------------------------------------------------
    def keyframe_latent(self, vae: nn.Module, frame: torch.Tensor) -> torch.Tensor:
        """encoders.py encode_vae_condition on one uint8 (3, H, W) keyframe -> (1, C, 1, h, w)."""
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
        param = next(vae.parameters())
        pixels = frame.to(param.device)[None, :, None]
        with torch.no_grad():
            return encode_vae_condition(vae, pixels, PIXEL_MEAN, PIXEL_STD, KEYFRAME_ENCODE_SEED)

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        if MediaRole.REFERENCE in media:
            if set(media) != {MediaRole.REFERENCE}:
                raise InvalidRequestError("ref2va takes image references only", field="media",
                                          expected=["reference"],
                                          actual=sorted(r.value for r in media))
            return self.encode_references(modules, sampling, media[MediaRole.REFERENCE],
                                          self.reference_short_edge)
        layout = self.layout(sampling)
        base = {LAYOUT: layout.encoded()}
        roles = [r for r in (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME) if r in media]
        extra = set(media) - set(roles)
        if extra:
            raise InvalidRequestError("MiniMax-H3 takes a first and / or a last keyframe",
                                      field="media", expected=["first_frame", "last_frame"],
                                      actual=sorted(r.value for r in media))
        if not roles:
            return MediaCondition(inputs=base, key=tuple(layout.encoded()[0].tolist()))
        if "vae" not in modules:
            raise InvalidRequestError("keyframes need the video VAE's encoder",
                                      field="media_modules", expected=["vae"],
                                      actual=sorted(modules))
        for role in roles:
            check_keyframe(media[role], sampling, f"media.{role.value}")
        latents = [self.keyframe_latent(modules["vae"], media[r]).float() for r in roles]
        from diffusers import MiniMaxH3Scheduler
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
        scheduler, rows = MiniMaxH3Scheduler(), []       # scale_noise reads no schedule
        for seed in sampling.seeds:          # the row's generator: one draw per keyframe first
            g = torch.Generator().manual_seed(int(seed))
            packed = []
            for z in latents:
                noise = torch.randn(z.shape, generator=g, dtype=torch.float32)
                noised = scheduler.scale_noise(z, KEYFRAME_NOISE_AUG, noise)
                packed.append(patchify_video_latents(noised, self.dims.patch))
            rows.append(torch.cat(packed))
        anchors = torch.tensor([[0 if r is MediaRole.FIRST_FRAME else 1 for r in roles]])
        return MediaCondition(inputs={**base, KEYFRAME_ROWS: torch.stack(rows),
                                      KEYFRAME_ANCHORS: anchors},
                              key=(*layout.encoded()[0].tolist(), *anchors[0].tolist()))


    def encode_references(self, modules, sampling: SamplingSpec,
                          references: Sequence[torch.Tensor], short_edge: int) -> MediaCondition:
        """ref2va with ordered image references (MiniMaxH3Ref2VASetupStep /
        MiniMaxH3Ref2VAReferenceEncoderStep / MiniMaxH3PrepareConditionLatentsStep): each image at
        its own size, already the one the pipeline normalises it to (`check_references`),
        encoded and noised as a keyframe is, in request order; the order is the request (labels,
        rotary clock)."""
        layout = self.layout(sampling)
        self.check_references(references, short_edge)
        if "vae" not in modules:
            raise InvalidRequestError("references need the video VAE's encoder",
                                      field="media_modules", expected=["vae"],
                                      actual=sorted(modules))
        from diffusers import MiniMaxH3Scheduler
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
        latents = [self.keyframe_latent(modules["vae"], image).float() for image in references]
        scheduler, rows = MiniMaxH3Scheduler(), []
        for seed in sampling.seeds:          # the row's generator: one draw per reference first
            g = torch.Generator().manual_seed(int(seed))
            rows.append(torch.cat([patchify_video_latents(
                scheduler.scale_noise(z, KEYFRAME_NOISE_AUG,
                                      torch.randn(z.shape, generator=g, dtype=torch.float32)),
                self.dims.patch) for z in latents]))
        geometry = torch.tensor([[list(z.shape[2:5]) for z in latents]], dtype=torch.long)
        return MediaCondition(inputs={LAYOUT: layout.encoded(), KEYFRAME_ROWS: torch.stack(rows),
                                      REFERENCE_GEOMETRY: geometry},
                              key=(*layout.encoded()[0].tolist(), *geometry.flatten().tolist()))

    def check_references(self, references: Sequence[torch.Tensor], short_edge: int) -> None:
        """1 to 9 uint8 (3, H, W) images, each already at the size the pipeline normalises it
        to (short edge `short_edge`, both edges multiples of the canvas multiple, 1:4 to 4:1);
        typed errors naming `media.reference` / `media.reference[i]` (no pixels are read)."""
        if not isinstance(references, (tuple, list)) or \
                not 1 <= len(references) <= MAX_IMAGE_REFERENCES:
            raise InvalidRequestError("ref2va takes 1 to 9 ordered image references",
                                      field="media.reference",
                                      expected=f"1..{MAX_IMAGE_REFERENCES}",
                                      actual=len(references) if isinstance(
                                          references, (tuple, list)) else type(references).__name__)
        multiple = self.dims.canvas_multiple
        for i, image in enumerate(references):
            field = f"media.reference[{i}]"
            if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or \
                    image.ndim != 3 or image.shape[0] != 3:
                raise MediaFormatError("a reference is a uint8 (3, H, W) image", field=field,
                                       expected="uint8 (3, H, W)",
                                       actual=f"{getattr(image, 'dtype', type(image).__name__)} "
                                       f"{tuple(getattr(image, 'shape', ()))}")
            h, w = int(image.shape[1]), int(image.shape[2])
            if min(h, w) != short_edge or h % multiple or w % multiple or \
                    not 0.25 <= w / h <= 4:
                raise MediaFormatError("a reference must already be at the size ref2va encodes it "
                                       "at; nothing is resized", field=field,
                                       expected=f"short edge {short_edge}, edges multiples of "
                                       f"{multiple}, 1:4 to 4:1", actual=(h, w))


def check_keyframe(frame: torch.Tensor, sampling: SamplingSpec, field: str) -> None:
    """A keyframe is uint8 (3, H, W) at the request's canvas: the pipeline would stretch or
    cover-crop another size onto it, the project refuses it (nothing is resized)."""
    want = (3, sampling.height, sampling.width)
    if frame.dtype != torch.uint8 or tuple(frame.shape) != want:
        raise MediaFormatError("a keyframe must be uint8 (3, H, W) at the request's height and "
                               "width; nothing is resized or cropped", field=field,
                               expected=f"uint8 {want}",
                               actual=f"{frame.dtype} {tuple(frame.shape)}")


# what build_ref2va_packed_sequence reads of an image reference (its geometry comes from the latent)
_IMAGE_REFERENCE = SimpleNamespace(kind="image", has_audio=False)


class MiniMaxH3Denoiser:
    """The packed forward, one row at a time (the transformer's batch axis replicates one
    layout: text length, per-row timesteps and keyframes differ between rows)."""

    time_convention = TimeConvention.DATA_PROGRESS
    model_time_scale = 1.0
    rows_per_call = 1              # each row's packed sequence runs alone (forward's loop)

    def __init__(self, codec: MiniMaxH3Codec, schedules: MiniMaxH3Schedules):
        self.codec, self.schedules = codec, schedules
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sequence_tokens(self, sampling: SamplingSpec, text_tokens: int,
                        keyframes: int) -> int:
        """Rows of one packed sequence (build_packed_sequence's layout): text, one latent
        frame per keyframe, the audio latents of both channels, the target video."""
        layout = self.codec.layout(sampling)
        return text_tokens + (keyframes + layout.frames // layout.dims.patch[0]) \
            * layout.rows_per_frame + layout.audio_rows

    def tables(self, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        if num_steps not in self._tables:
            self._tables[num_steps] = self.schedules.tables(num_steps)
        return self._tables[num_steps]

    def audio_timing(self, sigma: float, num_steps: int) -> tuple[float, float]:
        """(audio sigma, audio velocity scale) at video sigma `sigma` (module docstring)."""
        video, audio = self.tables(num_steps)
        hit = (video[:-1] == sigma).nonzero()
        if len(hit):
            i = int(hit[0])
            return float(audio[i]), float((audio[i] - audio[i + 1]) / (video[i] - video[i + 1]))
        sa, dsa = self.schedules.audio_sigma(torch.tensor(sigma, dtype=torch.float32))
        return float(sa), float(dsa)

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3PrepareLayoutStep, MiniMaxH3Ref2VAPrepareLayoutStep,
            MiniMaxH3SetTimestepsStep)
        layout = self.codec.layout_of(media)
        geometry = (media or {}).get(REFERENCE_GEOMETRY)
        name = "transformer" if geometry is None else "transformer_ref"   # ref2va's partition
        if name not in models:
            raise InvalidRequestError("this forward needs its transformer partition",
                                      field="models", expected=name, actual=sorted(models))
        transformer = models[name]
        video, audio = layout.tokens(state)
        anchors_in = (media or {}).get(KEYFRAME_ANCHORS)
        anchors = () if anchors_in is None else tuple(
            "first" if int(a) == 0 else "last" for a in anchors_in[0].tolist())
        keyframes = (media or {}).get(KEYFRAME_ROWS)
        out = []
        for r in range(state.shape[0]):
            length = int(cond["text_length"][r])
            embeds = cond["prompt_embeds"][r:r + 1, :length]
            tags = cond["text_tags"][r, :length]
            if geometry is None:
                position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond, _ = \
                    MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                        tags.cpu(), layout.frames, layout.rows, layout.cols, layout.audio,
                        layout.dims.patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, anchors)
            else:
                position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond, _ = \
                    MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                        tags.cpu(), [_IMAGE_REFERENCE] * geometry.shape[1],
                        [torch.empty(1, 1, *g, device="meta") for g in geometry[0].tolist()], [],
                        layout.frames, layout.rows, layout.cols, layout.audio,
                        layout.dims.patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG)
            if n_cond and not bool((tags == VIDEO_TAG).any()):
                raise InvalidRequestError("a keyframe / reference row needs its presentation "
                                          "(the conditioner's encode_presentation)",
                                          field="cond.text_tags", expected="vision blocks",
                                          actual="text only")
            s = sigma[r].float()
            t_video = 1.0 - s                        # scheduler.timesteps = 1 - sigmas[:-1]
            sa, audio_scale = self.audio_timing(float(s), layout.num_steps)
            t_audio = 1.0 - torch.tensor(sa, dtype=torch.float32)
            timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                video_idx, audio_idx, n_cond, 0, int(text_idx.numel()), float(t_video),
                float(t_audio), max(float(t_video), KEYFRAME_NOISE_AUG), 1.0)
            rows = video[r:r + 1]
            if n_cond:
                rows = torch.cat([keyframes[min(r, keyframes.shape[0] - 1)][None].to(rows), rows],
                                 dim=1)
            device = rows.device
            v_video, v_audio = transformer(
                hidden_states=rows, audio_hidden_states=audio[r:r + 1],
                encoder_hidden_states=embeds, timestep=timestep.to(device),
                timestep_indices=timestep_indices.to(device), token_tags=token_tags.to(device),
                position_ids=position_ids.to(device, torch.float32 if device.type == "mps"
                                             else position_ids.dtype),
                video_indices=video_idx.to(device), audio_indices=audio_idx.to(device),
                text_indices=text_idx.to(device), return_dict=False)
            # the scheduler's x0 = x + (1 - t) v: its sigma read back from the timestep
            video_factor = (1.0 - t_video) / s
            audio_factor = audio_scale * float((1.0 - t_audio) / sa)
            out.append(layout.state(v_video[:, n_cond:].float() * video_factor.to(device),
                                    v_audio.float() * audio_factor))
        return torch.cat(out).to(state.dtype)


class Qwen3VLConditioner(TokenizingConditioner):
    """Prompts -> Qwen3-VL ids (verbatim, no chat template, no special tokens:
    encoders.py MiniMaxH3TextEncoderStep) -> hidden_states[50] of the language model, run
    unpadded per prompt as the pipeline runs one request; rows padded to the encoder window
    (`max_sequence_length`, which a presentation with its vision blocks must fit too) with
    `text_length` saying how many are real (the denoiser reads only those)."""

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        ids = self.tokenizer(encoder)(text, add_special_tokens=False)["input_ids"]
        if len(ids) > encoder.max_length:
            raise LimitExceededError("prompt is longer than the encoder window", field=field,
                                     expected=f"<= {encoder.max_length} {encoder.name} tokens",
                                     actual=len(ids))
        if not ids:
            raise InvalidRequestError("MiniMax-H3 encodes at least one prompt token", field=field,
                                      expected=">= 1 token", actual=0)
        return tuple(ids), False

    def null_prompt(self) -> PromptBundle:
        raise InvalidRequestError("MiniMax-H3 is guidance-distilled: it has no unconditional "
                                  "prompt", field="guidance_scale", expected=1.0, actual=None)

    @staticmethod
    def hidden(encoder: nn.Module, ids: Sequence[int],
               vision: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """get_qwen3vl_prompt_embeds: hidden_states[50] of the language model, (1, L, D)."""
        config = encoder.config
        device = next(encoder.parameters()).device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        types = torch.zeros_like(input_ids)                 # create_mm_token_type_ids
        types[input_ids == config.image_token_id] = 1
        types[input_ids == config.video_token_id] = 2
        extra = {k: (v.to(device, next(encoder.parameters()).dtype)
                     if k.startswith("pixel_") else v.to(device))
                 for k, v in (vision or {}).items()}
        with torch.no_grad():
            out = encoder.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                mm_token_type_ids=types, use_cache=False,
                                output_hidden_states=True, **extra)
        return out.hidden_states[TEXT_LAYER]

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: Sequence[PromptBundle]) -> Condition:
        encoder = encoders[QWEN3_VL]
        names = self.spec.encoder_names
        hidden = [self.hidden(encoder, p.ids_by_encoder(names)[QWEN3_VL]) for p in prompts]
        return self.rows(hidden, [torch.full((h.shape[1],), TEXT_TAG) for h in hidden])

    def rows(self, hidden: Sequence[torch.Tensor], tags: Sequence[torch.Tensor]) -> Condition:
        """Per-prompt hidden states (1, L_i, D) -> rows padded to the encoder window (one shape
        for every condition of a run, which the trainer checks), `text_length` the real rows;
        a presentation longer than the window is refused by name."""
        window = self.spec.encoder(QWEN3_VL).max_length
        for i, h in enumerate(hidden):
            if h.shape[1] > window:
                raise LimitExceededError("the prompt with its keyframes' vision blocks is longer "
                                         "than the encoder window", field=f"prompts[{i}].{QWEN3_VL}",
                                         expected=f"<= {window}", actual=int(h.shape[1]))
        embeds = torch.zeros(len(hidden), window, hidden[0].shape[-1], dtype=hidden[0].dtype,
                             device=hidden[0].device)
        text_tags = torch.zeros(len(hidden), window, dtype=torch.long)
        for i, (h, t) in enumerate(zip(hidden, tags)):
            embeds[i, :h.shape[1]] = h[0]
            text_tags[i, :h.shape[1]] = t
        lengths = torch.tensor([h.shape[1] for h in hidden], dtype=torch.long)
        return Condition({"prompt_embeds": embeds, "text_tags": text_tags,
                          "text_length": lengths})

    def processor(self):
        """The checkpoint's Qwen3VLProcessor (its image processor makes the vision inputs)."""
        if "processor" not in self._tokenizers:
            from adapters.checkpoint import load_component
            self._tokenizers["processor"] = load_component(self.root, "processor")
        return self._tokenizers["processor"]

    def presentation(self, encoder: nn.Module, processor, prompt: PromptBundle,
                     images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden (1, L, D), tags (L,)) of the presentation MiniMaxH3FL2VATextEncoderStep /
        MiniMaxH3Ref2VATextEncoderStep build for keyframes / image references: per image a
        "<Picture i>: " label and a vision block (tagged video), then the prompt's ids."""
        tok = self.tokenizer(self.spec.encoder(QWEN3_VL))
        arrays = [np.ascontiguousarray(k.permute(1, 2, 0).cpu().numpy()) for k in images]
        vision = processor.image_processor(images=arrays, return_tensors="pt")
        grid = vision["image_grid_thw"]
        merge = processor.image_processor.merge_size ** 2
        ids: list[int] = []
        tags: list[int] = []
        for i in range(len(images)):
            label = tok(f"<Picture {i + 1}>: ", add_special_tokens=False)["input_ids"]
            block = ([tok.convert_tokens_to_ids("<|vision_start|>")]
                     + [tok.convert_tokens_to_ids("<|image_pad|>")] * (int(grid[i].prod()) // merge)
                     + [tok.convert_tokens_to_ids("<|vision_end|>")])
            ids += label + block
            tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        prompt_ids = list(prompt.ids_by_encoder(self.spec.encoder_names)[QWEN3_VL])
        ids += prompt_ids
        tags += [TEXT_TAG] * len(prompt_ids)
        hidden = self.hidden(encoder, ids, {"pixel_values": vision["pixel_values"],
                                            "image_grid_thw": grid})
        return hidden, torch.tensor(tags)

    def encode_presentation(self, encoder: nn.Module, processor, prompt: PromptBundle,
                            images: Sequence[torch.Tensor]) -> Condition:
        hidden, tags = self.presentation(encoder, processor, prompt, images)
        return self.rows([hidden], [tags])

    media_roles = (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME, MediaRole.REFERENCE)

    def encode_with_media(self, encoders, prompts, media) -> Condition:
        """Each prompt with its keyframes (first, then last, as the pipeline packs them) in the
        FL2VA presentation, or its ordered image references (`reference`: a tuple, request order)
        in the ref2va one; a prompt without either as `encode` encodes it."""
        encoder = encoders[QWEN3_VL]
        names = self.spec.encoder_names
        hidden, tags = [], []
        for prompt, item in zip(prompts, media):
            frames = list(item.get(MediaRole.REFERENCE, ())) + [
                item[r] for r in (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME) if r in item]
            if frames:
                h, t = self.presentation(encoder, self.processor(), prompt, frames)
            else:
                h = self.hidden(encoder, prompt.ids_by_encoder(names)[QWEN3_VL])
                t = torch.full((h.shape[1],), TEXT_TAG)
            hidden.append(h)
            tags.append(t)
        return self.rows(hidden, tags)


class MiniMaxH3Family(CheckpointFamily):
    """MiniMax-H3 checkpoints (MiniMaxH3ModularPipeline layout, `transformer/` partition)."""

    entry_name = "minimax_h3"

    def __init__(self, root: str | Path, options: Mapping | None = None):
        super().__init__(root, options)
        self.dims = MiniMaxH3Dims(self.root)
        self.schedules = MiniMaxH3Schedules(self.root)
        self.codec = MiniMaxH3Codec(self.dims, self.options.reference_image_short_edge)
        self.denoiser = MiniMaxH3Denoiser(self.codec, self.schedules)
        transformers = ("transformer", "transformer_ref") if self.options.ref2va else \
            ("transformer",)
        if self.options.ref2va and not (self.root / "transformer_ref").is_dir():
            raise ConfigError("ref2va runs the checkpoint's transformer_ref partition",
                              field="adapter_options.ref2va", expected="a transformer_ref/ folder",
                              actual=str(self.root))
        encoder = EncoderSpec(QWEN3_VL, TEXT_ENCODER, "tokenizer",
                              self.options.max_sequence_length, Overflow.REJECT,
                              QWEN3_VL_ETP_PLAN, encoder_vocab_size(self.root, TEXT_ENCODER))
        self.spec = FamilySpec(
            name="minimax_h3",
            io_spec=IOSpec(artifacts=(
                ArtifactSpec("video_latent", Modality.VIDEO, Representation.LATENT,
                             Layout.LATENT_CTHW),
                ArtifactSpec("audio_latent", Modality.AUDIO, Representation.LATENT,
                             Layout.TOKENS),
                ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                             fps=float(FPS), source="video_latent"),
                ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                             sample_rate=self.dims.sample_rate, source="audio_latent")),
                defaults=("video_latent", "audio_latent", "video", "audio")),
            tasks={Task.T2VA: (), Task.I2VA: (MediaRole.FIRST_FRAME,),
                   Task.L2VA: (MediaRole.LAST_FRAME,),
                   Task.FL2VA: (MediaRole.FIRST_FRAME, MediaRole.LAST_FRAME),
                   **({Task.REF2VA: (MediaRole.REFERENCE,)} if self.options.ref2va else {})},
            time_convention=TimeConvention.DATA_PROGRESS, model_time_scale=1.0,
            guidance=GuidanceRule(GuidanceKind.NONE, source="minimax_h3/denoise.py:54-57"),
            transformers=transformers,
            lora_targets={t: MINIMAX_H3_LORA_TARGETS for t in transformers}, encoders=(encoder,),
            decoders={"video_latent": ("vae",), "audio_latent": ("audio_vae",)},
            media_encoders=("vae",),
            sampling_defaults={"height": 768, "width": 1344, "num_frames": 124})
        self.conditioner = Qwen3VLConditioner(self.spec, self.root)

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        return self.denoiser.tables(sampling.num_steps)[0].clone()

    def audio_sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        """The audio scheduler's table for this sampling (what the audio rows step down)."""
        return self.denoiser.tables(sampling.num_steps)[1].clone()

    def pipeline_scheduler(self, sampling: SamplingSpec):
        return self.schedules.scheduler("scheduler", sampling.num_steps)

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedules.shifts["scheduler"]

    def validate_request(self, request: RolloutRequest, limits: RequestLimits):
        media = super().validate_request(request, limits)     # keyframes at the canvas size
        with request_errors(request.request_id):
            self.sigmas(request.sampling)
            if MediaRole.REFERENCE in media:                   # count, order, sizes: no pixels
                self.codec.check_references(media[MediaRole.REFERENCE],
                                            self.options.reference_image_short_edge)
        return media
