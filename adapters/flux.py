"""FLUX.1 from a local diffusers checkpoint (FluxPipeline layout).

Components: transformer (FluxTransformer2DModel), vae (AutoencoderKL), text_encoder
(CLIPTextModel: pooled output only), text_encoder_2 (T5EncoderModel), tokenizer(_2), scheduler
(FlowMatchEulerDiscreteScheduler with use_dynamic_shifting).

As FluxPipeline (diffusers 0.42.1, pipeline_flux.py):
  state        packed latents (B, (H/16)(W/16), 4 C): 2x2 latent patches as tokens (the
               model-native layout `output_type="latent"` returns)
  sigmas       linspace(1, 1/N, N) through the scheduler with mu = calculate_shift(seq length)
  model time   timestep = 1000 sigma, the transformer gets timestep / 1000
  guidance     FLUX.1-dev is guidance-distilled: the scale is a model input (EMBEDDED), one
               forward per row, any scale (pipeline_flux.py:847-848); a checkpoint without
               guidance embeddings (schnell) takes no guidance at all (NONE: the pipeline
               ignores the scale, the project refuses any but 1). True CFG
               (`do_true_cfg = true_cfg_scale > 1 and has_neg_prompt`, pipeline_flux.py:771)
               needs a negative prompt, which the project refuses: it never runs.
  edit         FLUX.1 Kontext (FluxKontextPipeline, pipeline_flux_kontext.py): the source image
               (media role `image`, uint8, sides multiples of 16: the pipeline would round and
               resize, :943-945; refused here) VAE-encoded (posterior mode, :599-611), packed
               and appended after the noisy tokens (:1038) with position ids [1, row, col]
               (:663); the output is cut back to the noisy tokens (:1052); mu from the noisy
               tokens alone (:966). The transformer is FLUX.1-dev's class and config, so every
               FLUX checkpoint serves both tasks (its weights decide how well).
Checkpoints saved by any pipeline class over these components load (adapters/families.py); a
transformer that takes condition channels (FLUX.1 Fill / Control) is refused.
  ids          txt_ids zeros (L, 3); img_ids [0, row, col] of the packed grid
CLIP truncates to 77 tokens as the pipeline does (recorded); T5 rejects prompts longer than
`max_sequence_length`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.checkpoint import read_json
from adapters.diffusers_parts import (CLIP_TEXT_MODEL_ETP_PLAN, T5_ETP_PLAN, FlowSchedule,
                                      ImageVAE, TokenizingConditioner, clip_pooled,
                                      encoder_vocab_size, t5_hidden, tokenizer_max_length)
from adapters.family import (CheckpointFamily, EncoderSpec, FamilySpec, MediaCondition,
                             OneLatentCodec, Overflow, check_source_image, image_io_spec,
                             request_errors)
from contract import (Condition, ConfigError, GuidanceKind, InvalidRequestError, Layout,
                      MediaFormatError, MediaRole, PromptBundle,
                      RequestLimits, RolloutRequest, SamplingSpec, Task, TimeConvention)
from diffusion.guidance import GuidanceRule

FLUX_LORA_TARGETS = (
    # double-stream blocks (transformer_blocks.*): image and text streams
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    # single-stream blocks (single_transformer_blocks.*)
    "proj_mlp", "proj_out")


class FluxOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(512, ge=1, le=512, description="T5 window.")


class FluxConditioner(TokenizingConditioner):
    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: list[PromptBundle]) -> Condition:
        with torch.no_grad():
            pooled = clip_pooled(encoders["clip"], self.padded("clip", prompts))    # (P, 768)
            embeds = t5_hidden(encoders["t5"], self.padded("t5", prompts))          # (P, L, D)
        return Condition({"prompt_embeds": embeds, "pooled": pooled.to(embeds.dtype)})


class FluxDenoiser:
    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0       # the pipeline's timestep; the transformer gets it / 1000

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(embeds.shape[1], 3, device=embeds.device, dtype=embeds.dtype)
        source = media.get(SOURCE_LATENTS)        # edit: the source image's tokens follow
        hidden = state if source is None else torch.cat([state, source.to(state.dtype)], dim=1)
        out = models["transformer"](
            hidden_states=hidden, timestep=model_time.to(state.dtype) / 1000,
            guidance=guidance, pooled_projections=cond["pooled"], encoder_hidden_states=embeds,
            txt_ids=text_ids, img_ids=media["img_ids"][0], return_dict=False)[0]
        return out[:, :state.shape[1]]             # pipeline_flux_kontext.py:1052


SOURCE_LATENTS = "source_latents"   # media input of an edit row: the packed source image


def latent_image_ids(rows: int, cols: int, index: float = 0.0) -> torch.Tensor:
    """(rows * cols, 3): [index, row, col] per packed token (the pipeline's image position ids;
    Kontext's source image tokens carry index 1, pipeline_flux_kontext.py:663)."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 0] = index
    ids[..., 1] = ids[..., 1] + torch.arange(rows)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


class FluxCodec(OneLatentCodec):
    latent_name, label = 'image_latent', 'FLUX'     # packed tokens (B, L, 4C)

    def __init__(self, vae: ImageVAE, in_channels: int):
        self.vae, self.in_channels = vae, in_channels        # in_channels = 4 * latent channels

    def grid(self, sampling: SamplingSpec) -> tuple[int, int]:
        f = self.vae.scale_factor
        self.vae.check_size(sampling.height, sampling.width, 2 * f, "FLUX")
        if sampling.num_frames != 1:
            raise InvalidRequestError("FLUX generates single images",
                                      field="sampling.num_frames", expected=1,
                                      actual=sampling.num_frames)
        return sampling.height // (2 * f), sampling.width // (2 * f)

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        rows, cols = self.grid(sampling)
        return (rows * cols, self.in_channels)

    def unpack(self, tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """(B, rows*cols, 4C) packed tokens -> (B, C, 2 rows, 2 cols) latents."""
        b, _, channels = tokens.shape
        x = tokens.view(b, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, channels // 4, 2 * rows, 2 * cols)

    def source_grid(self, image: torch.Tensor) -> tuple[int, int]:
        """The packed grid of an edit's source image: uint8 (3, H, W), H and W multiples of
        VAE x 2 (the pipeline would round them down and resize; nothing is resized here)."""
        multiple = 2 * self.vae.scale_factor
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3 or \
                image.shape[1] % multiple or image.shape[2] % multiple:
            raise MediaFormatError(f"an edit's source image is uint8 (3, H, W) with H and W "
                                   f"multiples of {multiple} (nothing is resized)",
                                   field="media.image", expected=f"uint8 (3, {multiple} k, "
                                   f"{multiple} m)", actual=f"{image.dtype} {tuple(image.shape)}")
        return image.shape[1] // multiple, image.shape[2] // multiple

    def encode_media(self, modules, sampling, media) -> MediaCondition:
        extra = sorted(r.value for r in media if r is not MediaRole.IMAGE)
        if extra:
            raise InvalidRequestError("FLUX.1 takes a source image (edit) or no media",
                                      field="media", expected=[MediaRole.IMAGE.value],
                                      actual=extra)
        rows, cols = self.grid(sampling)
        ids = latent_image_ids(rows, cols)
        if MediaRole.IMAGE not in media:
            return MediaCondition(inputs={"img_ids": ids[None]}, key=(rows, cols))
        source = media[MediaRole.IMAGE]
        src_rows, src_cols = self.source_grid(source)
        latents = self.vae.encode(modules["vae"], source[None])       # (1, C, 2 r, 2 c)
        packed = latents.view(1, -1, src_rows, 2, src_cols, 2).permute(0, 2, 4, 1, 3, 5) \
            .reshape(1, src_rows * src_cols, self.in_channels)
        ids = torch.cat([ids, latent_image_ids(src_rows, src_cols, 1.0)])
        return MediaCondition(inputs={"img_ids": ids[None], SOURCE_LATENTS: packed},
                              key=(rows, cols, src_rows, src_cols))

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        self.check_latent(latent_name, latent, sampling)
        rows, cols = self.grid(sampling)
        return self.vae.decode(modules["vae"], self.unpack(latent.float(), rows, cols))


class FluxFamily(CheckpointFamily):
    """FluxPipeline checkpoints (FLUX.1-dev with guidance embeddings, FLUX.1-schnell without)."""

    entry_name = "flux"

    def __init__(self, root: str | Path, options: Mapping | FluxOptions | None = None):
        super().__init__(root, options)
        transformer = read_json(self.root, "transformer", "config.json")
        self.schedule = FlowSchedule(self.root)
        vae = ImageVAE(self.root)
        packed = 4 * vae.latent_channels                  # 2x2 latent patches per token
        for key in ("in_channels", "out_channels"):
            value = transformer.get(key) or transformer.get("in_channels")
            if value != packed:
                raise ConfigError("the transformer's channels are not the VAE's packed "
                                  "latents (a Fill / Control transformer takes condition "
                                  "channels: not served)",
                                  field=f"weights_path.transformer.{key}", expected=packed,
                                  actual=value)
        encoders = (EncoderSpec("clip", "text_encoder", "tokenizer",
                                tokenizer_max_length(self.root, "tokenizer"), Overflow.TRUNCATE,
                                CLIP_TEXT_MODEL_ETP_PLAN,
                                encoder_vocab_size(self.root, "text_encoder")),
                    EncoderSpec("t5", "text_encoder_2", "tokenizer_2",
                                self.options.max_sequence_length, Overflow.REJECT, T5_ETP_PLAN,
                                encoder_vocab_size(self.root, "text_encoder_2")))
        guidance = GuidanceRule(GuidanceKind.EMBEDDED, source="pipeline_flux.py:847") if \
            transformer.get("guidance_embeds") else \
            GuidanceRule(GuidanceKind.NONE, source="pipeline_flux.py:850")
        side = 128 * vae.scale_factor       # FLUX.1's native 1024 px
        self.spec = FamilySpec(
            name="flux", io_spec=image_io_spec(Layout.TOKENS),
            tasks={Task.T2I: (), Task.EDIT: (MediaRole.IMAGE,)}, media_encoders=("vae",),
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=guidance, transformers=("transformer",),
            lora_targets={"transformer": FLUX_LORA_TARGETS}, encoders=encoders,
            decoders={"image_latent": ("vae",)},
            sampling_defaults={"height": side, "width": side, "num_frames": 1})
        self.conditioner = FluxConditioner(self.spec, self.root)
        self.denoiser = FluxDenoiser()
        self.codec = FluxCodec(vae, int(transformer["in_channels"]))

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        n = sampling.num_steps
        custom = None if self.schedule.config.get("use_flow_sigmas") else \
            np.linspace(1.0, 1 / n, n)
        return self.schedule.sigmas(n, self.codec.state_shape(sampling)[0], custom)

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedule.static_shift(self.codec.state_shape(sampling)[0])

    def validate_request(self, request: RolloutRequest, limits: RequestLimits):
        if request.prompt.negative is not None:
            raise InvalidRequestError("FLUX.1 is guidance-distilled: it takes no negative "
                                      "prompt", field="prompt.negative", expected=None,
                                      actual="a negative prompt",
                                      request_id=request.request_id)
        media = super().validate_request(request, limits)
        if MediaRole.IMAGE in media:             # an edit's source image, before any work
            with request_errors(request.request_id):
                check_source_image(media[MediaRole.IMAGE], limits)
                self.codec.source_grid(media[MediaRole.IMAGE])
        return media
