"""LTX-2 (joint text -> video + audio) from a local diffusers checkpoint (LTX2Pipeline layout).

Components: transformer (LTX2VideoTransformer3DModel: one transformer over video and audio
token streams), vae (AutoencoderKLLTX2Video), audio_vae (AutoencoderKLLTX2Audio, mel), vocoder
(LTX2Vocoder), text_encoder (Gemma3ForConditionalGeneration), connectors (LTX2TextConnectors),
tokenizer (Gemma), scheduler (FlowMatchEulerDiscreteScheduler, dynamic shift, shift_terminal).

As LTX2Pipeline / LTX2ImageToVideoPipeline / LTX2ConditionPipeline (diffusers 0.42.1):
  text        adapters/ltx2_text.py (Gemma hidden states -> connectors -> two contexts)
  state       adapters/ltx2_codec.py ([video tokens | audio tokens], normalised, flat)
  sigmas      linspace(1, 1/N, N) through the checkpoint's scheduler with mu =
              calculate_shift(video tokens, 1024, 4096, 0.95, 2.05) and its shift_terminal;
              the audio stream uses the same table (the pipeline steps a deep copy of the
              scheduler, pipeline_ltx2.py:1353-1370). A last-frame keyframe's tokens count in mu,
              as LTX2ConditionPipeline counts them (latents.shape[1]).
  model time  timestep = 1000 sigma for both streams and `sigma=` (LTX-2.3's prompt
              modulation); condition tokens get timestep 0 (t * (1 - conditioning_mask)).
  guidance    CFG rows [negative, positive]; per stream in x0 space: x0_c + (g - 1)(x0_c - x0_u),
              guidance rescale phi per stream, back to a velocity (diffusion.guidance.GuidanceForm,
              applied by diffusion/step.py). Video uses the request's guidance_scale, audio the
              configured audio_guidance_scale (the pipeline's default 7; None = the video scale).
              CFG runs when guidance_scale > 1 or audio_guidance_scale > 1
              (`do_classifier_free_guidance`, pipeline_ltx2.py:903,
              pipeline_ltx2_image2video.py:957, pipeline_ltx2_condition.py:1322), with both
              streams' deltas (a video scale <= 1 is applied as such); otherwise the
              conditional branch alone.
              STG and modality-isolation guidance each need another forward per step: not
              supported; stg_scale != 0 or modality_scale != 1 is a ConfigError.
  sampler     one sampler over both streams: same sigma, same SDE noise level, per-entry noise,
              the log-prob summing video and audio entries (see docs/MODEL_FAMILIES.md).
  conditions  first frame in place (frozen tokens, timestep 0), a last frame as appended
              keyframe tokens at their own positions (frozen, timestep 0); frames must be uint8
              at the request size (never resized).
Folders saved by any LTX-2 pipeline class over these components load (adapters/families.py)
and serve every task above.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from adapters.checkpoint import read_json
from adapters.diffusers_parts import FlowSchedule
from adapters.family import (FRAME_ROLES, CheckpointFamily, EncoderSpec, FamilySpec,
                             MediaCondition, Overflow, request_errors)
from adapters.ltx2_codec import CONDITION_MASK, LTX2Codec, LTX2Dims
from adapters.ltx2_text import (CONNECTORS, GEMMA, GEMMA3_ETP_PLAN, TEXT_ENCODER,
                                GemmaConditioner, LTX2TextStack)
from contract import (ArtifactSpec, Condition, ConfigError, GuidanceKind, InvalidRequestError,
                      IOSpec, Layout, MediaRole, Modality, Representation, RequestLimits,
                      RolloutRequest, SamplingSpec, Task, TimeConvention)
from diffusion.guidance import CFGRule, GuidanceForm, GuidanceRule, GuidanceSpace, GuidanceStream

# every attention of both streams (self, text cross, audio<->video cross) and both FFs
LTX2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
DEFAULT_IMAGE_CRF = {"gemma3": 33, "gemma4": 18, "gemma4_unified": 18}  # pipeline utils.py:326


class LTX2Options(BaseModel):
    """Settings of an LTX-2 deployment (config `rollout.adapter_options`); defaults are the
    pipelines' own where the project supports them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(1024, ge=1, le=4096, description="Gemma window.")
    frame_rate: float = Field(24.0, gt=0, le=240, description="Playback fps of the video; "
                              "sizes the audio and the positional embeddings.")
    motion_speed: float = Field(1.0, gt=0, description="RoPE uses frame_rate / motion_speed.")
    audio_guidance_scale: float | None = Field(7.0, ge=0, description="Audio CFG scale; None "
                                               "(or 0, as the pipeline reads it) = the "
                                               "request's guidance_scale.")
    guidance_rescale: float = Field(0.7, ge=0, le=1)
    audio_guidance_rescale: float | None = Field(None, ge=0, le=1,
                                                 description="None = guidance_rescale.")
    stg_scale: float = Field(0.0, description="Spatio-temporal guidance: unsupported (0).")
    modality_scale: float = Field(1.0, description="Modality isolation: unsupported (1).")
    use_cross_timestep: bool = True
    image_crf: int | None = Field(None, ge=0, le=51, description="H.264 CRF condition frames "
                                  "are re-compressed at; None = the pipeline's default for the "
                                  "checkpoint's text encoder (33 for Gemma 3), 0 = none.")

    @field_validator("stg_scale")
    @classmethod
    def _no_stg(cls, value: float) -> float:
        if value != 0:
            raise ValueError("spatio-temporal guidance needs a perturbed extra forward per "
                             "step, which the project does not run: set stg_scale 0")
        return value

    @field_validator("modality_scale")
    @classmethod
    def _no_modality(cls, value: float) -> float:
        if value != 1:
            raise ValueError("modality-isolation guidance needs an extra forward per step, "
                             "which the project does not run: set modality_scale 1")
        return value


class LTX2Schedule(FlowSchedule):
    """The checkpoint's scheduler with LTX2Pipeline's calculate_shift defaults."""

    shift_defaults = {"base_image_seq_len": 1024, "max_image_seq_len": 4096, "base_shift": 0.95,
                      "max_shift": 2.05}


class LTX2Denoiser:
    """state (B, N) flat [video | audio] tokens; media: layout, stream bounds, condition mask."""

    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0

    def __init__(self, codec: LTX2Codec, fps: float, use_cross_timestep: bool,
                 guidance_form: GuidanceForm):
        self.codec, self.fps, self.use_cross_timestep = codec, fps, use_cross_timestep
        self.guidance_form = guidance_form

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        layout = self.codec.layout_of(media)
        video, audio = layout.tokens(state)
        transformer = models["transformer"]
        rows, device = state.shape[0], state.device
        t = model_time.float()                                               # (B,) in [0, 1000]
        mask = (media or {}).get(CONDITION_MASK)
        video_t = t if mask is None else t[:, None] * (1 - mask.expand(rows, -1).float())
        coords = transformer.rope.prepare_video_coords(rows, layout.frames, layout.rows,
                                                       layout.cols, device, fps=self.fps)
        if layout.keyframes:
            coords = torch.cat([coords] + [self.keyframe_coords(layout, k, rows, device)
                                           for k in layout.keyframes], dim=2)
        audio_coords = transformer.audio_rope.prepare_audio_coords(rows, layout.audio_length,
                                                                   device)
        v_video, v_audio = transformer(
            hidden_states=video, audio_hidden_states=audio,
            encoder_hidden_states=cond["video_context"],
            audio_encoder_hidden_states=cond["audio_context"], timestep=video_t,
            audio_timestep=t, sigma=t, audio_sigma=t,
            encoder_attention_mask=cond["context_mask"],
            audio_encoder_attention_mask=cond["context_mask"], num_frames=layout.frames,
            height=layout.rows, width=layout.cols, fps=self.fps,
            audio_num_frames=layout.audio_length, video_coords=coords, audio_coords=audio_coords,
            isolate_modalities=False, spatio_temporal_guidance_blocks=None,
            perturbation_mask=None, use_cross_timestep=self.use_cross_timestep,
            return_dict=False)
        return layout.state(v_video, v_audio)

    def keyframe_coords(self, layout, pixel_frame: int, rows: int, device) -> torch.Tensor:
        """(B, 3, h*w, 2) [start, end) pixel-space bounds of a one-frame keyframe's patches:
        the latent grid scaled by the VAE ratios, shifted to `pixel_frame` without the causal
        first-frame fix, its temporal extent one pixel frame, time in seconds."""
        d = layout.dims
        f = torch.arange(0, 1, d.patch_t, dtype=torch.float32, device=device)
        h = torch.arange(0, layout.rows, d.patch, dtype=torch.float32, device=device)
        w = torch.arange(0, layout.cols, d.patch, dtype=torch.float32, device=device)
        start = torch.stack(torch.meshgrid(f, h, w, indexing="ij"), dim=0).flatten(1)  # (3, n)
        size = torch.tensor([d.patch_t, d.patch, d.patch], dtype=torch.float32, device=device)
        scale = torch.tensor([d.temporal_ratio, d.spatial_ratio, d.spatial_ratio],
                             dtype=torch.float32, device=device)
        bounds = torch.stack([start, start + size[:, None]], dim=-1) * scale[:, None, None]
        bounds[0] = bounds[0] + pixel_frame
        bounds[0, :, 1] = bounds[0, :, 0] + 1
        bounds[0] = bounds[0] / self.fps
        return bounds[None].expand(rows, -1, -1, -1)


class LTX2Family(CheckpointFamily):
    """LTX-2 checkpoints (LTX-2.0 layout): T2VA, I2VA (first frame), FL2VA."""

    entry_name = "ltx2"

    def __init__(self, root: str | Path, options: Mapping | LTX2Options | None = None):
        super().__init__(root, options)
        o = self.options
        self.schedule = LTX2Schedule(self.root)
        dims = self._dims()
        crf = o.image_crf
        if crf is None:
            text = read_json(self.root, TEXT_ENCODER, "config.json")
            crf = DEFAULT_IMAGE_CRF.get(text.get("model_type"), 33)
        self.codec = LTX2Codec(dims, crf)
        audio_scale = o.audio_guidance_scale or None
        self.audio_guidance_scale = audio_scale
        rescale = o.guidance_rescale
        audio_rescale = o.audio_guidance_rescale or rescale     # the pipeline's `or` fallback
        form = GuidanceForm(GuidanceSpace.X0, (GuidanceStream("video", None, rescale),
                                               GuidanceStream("audio", audio_scale,
                                                              audio_rescale)))
        self.denoiser = LTX2Denoiser(self.codec, o.frame_rate / o.motion_speed,
                                     o.use_cross_timestep, form)
        connectors = read_json(self.root, CONNECTORS, "config.json")
        encoder = EncoderSpec(GEMMA, TEXT_ENCODER, "tokenizer", o.max_sequence_length,
                              Overflow.REJECT, GEMMA3_ETP_PLAN, extra_components=(CONNECTORS,))
        self.spec = FamilySpec(
            name="ltx2",
            io_spec=IOSpec(artifacts=(
                ArtifactSpec("video_latent", Modality.VIDEO, Representation.LATENT,
                             Layout.LATENT_CTHW),
                ArtifactSpec("audio_latent", Modality.AUDIO, Representation.LATENT,
                             Layout.LATENT_CLM),
                ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                             fps=o.frame_rate, source="video_latent"),
                ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                             sample_rate=dims.output_rate, source="audio_latent")),
                defaults=("video_latent", "audio_latent", "video", "audio")),
            tasks={Task.T2VA: (), Task.I2VA: (MediaRole.FIRST_FRAME,), Task.FL2VA: FRAME_ROLES},
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE,
                                  () if audio_scale is None else (audio_scale,),
                                  source="pipeline_ltx2.py:903"),
            transformers=("transformer",),
            lora_targets={"transformer": LTX2_LORA_TARGETS}, encoders=(encoder,),
            decoders={"video_latent": ("vae",), "audio_latent": ("audio_vae", "vocoder")},
            media_encoders=("vae",),
            sampling_defaults={"height": 512, "width": 768, "num_frames": 121})
        self.conditioner = GemmaConditioner(
            self.spec, self.root, connectors.get("video_connector_num_learnable_registers"))

    def _dims(self) -> LTX2Dims:
        vae = read_json(self.root, "vae", "config.json")
        audio = read_json(self.root, "audio_vae", "config.json")
        vocoder = read_json(self.root, "vocoder", "config.json")
        transformer = read_json(self.root, "transformer", "config.json")
        scaling = sum(vae.get("spatio_temporal_scaling", ()))
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2 ** scaling
        temporal = vae.get("temporal_compression_ratio") or \
            vae.get("patch_size_t", 1) * 2 ** scaling
        mel_bins = int(audio.get("mel_bins", 64))
        dims = LTX2Dims(
            spatial_ratio=int(spatial), temporal_ratio=int(temporal),
            patch=int(transformer.get("patch_size", 1)),
            patch_t=int(transformer.get("patch_size_t", 1)),
            latent_channels=int(vae.get("latent_channels", 128)),
            audio_channels=int(audio.get("latent_channels", 8)), latent_mel_bins=mel_bins // 4,
            audio_rate=int(audio.get("sample_rate", 16000)),
            hop=int(audio.get("mel_hop_length", 160)), audio_ratio=4,
            frame_rate=self.options.frame_rate,
            output_rate=int(vocoder.get("output_sampling_rate", 24000)))
        for name, want, got in (("transformer.in_channels", dims.video_features,
                                 transformer.get("in_channels")),
                                ("transformer.audio_in_channels", dims.audio_features,
                                 transformer.get("audio_in_channels"))):
            if got != want:
                raise ConfigError("the transformer's input width does not match the VAEs",
                                  field=f"weights_path.{name}", expected=want, actual=got)
        return dims

    # ---- schedule -------------------------------------------------------------------------
    def _sigmas(self, sampling: SamplingSpec, tokens: int) -> torch.Tensor:
        n = sampling.num_steps
        sigmas = self.schedule.sigmas(n, tokens, np.linspace(1.0, 1 / n, n))
        if not bool(torch.isfinite(sigmas).all()):     # shift_terminal stretches 0 / 0 at N = 1
            raise InvalidRequestError("the checkpoint's schedule (shift_terminal) is undefined "
                                      "at this step count", field="sampling.num_steps",
                                      expected=">= 2", actual=n)
        return sigmas

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        return self._sigmas(sampling, self.codec.layout(sampling).video_tokens)

    def conditioned_sigmas(self, sampling: SamplingSpec, media: MediaCondition) -> torch.Tensor:
        layout = self.codec.layout_of(media.inputs)
        return self._sigmas(sampling, layout.video_tokens + layout.keyframe_tokens)

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedule.static_shift(self.codec.layout(sampling).video_tokens)

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, dtype=torch.float32, device="cpu") -> dict[str, nn.Module]:
        """Gemma 3 and the connectors as one encoder (the TextEncoder stage runs both)."""
        stack = LTX2TextStack(self.load(TEXT_ENCODER, dtype, device),
                              self.load(CONNECTORS, dtype, device))
        return {GEMMA: stack.eval().requires_grad_(False)}

    # ---- request checks ------------------------------------------------------------------
    def validate_request(self, request: RolloutRequest, limits: RequestLimits):
        media = super().validate_request(request, limits)     # frames at the request's size
        rid, sampling = request.request_id, request.sampling
        with request_errors(rid):
            self.sigmas(sampling)
        if MediaRole.LAST_FRAME in media and self.codec.layout(sampling).frames < 2:
            raise InvalidRequestError("a last-frame condition needs at least two latent frames",
                                      field="sampling.num_frames",
                                      expected=f">= {self.codec.dims.temporal_ratio + 1}",
                                      actual=sampling.num_frames, request_id=rid)
        return media
