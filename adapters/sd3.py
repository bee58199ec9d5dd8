"""Stable Diffusion 3 / 3.5 from a local diffusers checkpoint (StableDiffusion3Pipeline layout).

Components: transformer (SD3Transformer2DModel), vae (AutoencoderKL), text_encoder /
text_encoder_2 (CLIPTextModelWithProjection, CLIP-L and CLIP-G), text_encoder_3 (T5EncoderModel,
optional: a checkpoint without it conditions on zeros, as the pipeline does), tokenizer(_2, _3),
scheduler (FlowMatchEulerDiscreteScheduler, static shift 3.0 for SD3.5).

As StableDiffusion3Pipeline (diffusers 0.42.1, pipeline_stable_diffusion_3.py):
  prompt_embeds = cat_seq(pad_dim(cat_dim(CLIP-L h[-2], CLIP-G h[-2]), T5 dim), T5 states)
  pooled        = cat_dim(CLIP-L pooled, CLIP-G pooled)
  model time    = 1000 sigma (NOISE_LEVEL), true CFG ([uncond; cond] rows), negative prompt or
                  the empty prompt as the unconditional branch; latents (B, C, H/8, W/8) in the
                  VAE's scaled space (output_type="latent").
  guidance      CFG only at guidance_scale > 1 (`do_classifier_free_guidance`,
                  pipeline_stable_diffusion_3.py:681; img2img :741, inpaint :829): at or below
                  1 the conditional branch alone.
Checkpoints saved by any pipeline class over these components load (adapters/families.py).
CLIP windows truncate to 77 tokens as the pipeline does (recorded in PromptBundle.truncated);
T5 rejects prompts longer than `max_sequence_length` (the pipeline would cut them silently).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from adapters.checkpoint import read_json
from adapters.diffusers_parts import (CLIP_ETP_PLAN, T5_ETP_PLAN, FlowSchedule, ImageVAE,
                                      TokenizingConditioner, clip_hidden_and_pooled,
                                      encoder_vocab_size, t5_hidden, tokenizer_max_length)
from adapters.family import (CheckpointFamily, EncoderSpec, FamilySpec, OneLatentCodec, Overflow,
                             image_io_spec)
from contract import (Condition, GuidanceKind, InvalidRequestError, Layout, PromptBundle,
                      SamplingSpec, Task, TimeConvention)
from diffusion.guidance import CFGRule, GuidanceRule

SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
SD3_GUIDANCE = GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE,
                            source="pipeline_stable_diffusion_3.py:681")


class SD3Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequence_length: int = Field(256, ge=1, le=512, description="T5 window (the "
                                     "pipeline's max_sequence_length).")


class SD3Conditioner(TokenizingConditioner):
    def __init__(self, spec: FamilySpec, root: Path, joint_attention_dim: int, t5_window: int):
        super().__init__(spec, root)
        self.joint_attention_dim, self.t5_window = joint_attention_dim, t5_window

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: list[PromptBundle]) -> Condition:
        with torch.no_grad():
            h_l, pooled_l = clip_hidden_and_pooled(encoders["clip_l"],
                                                   self.padded("clip_l", prompts))
            h_g, pooled_g = clip_hidden_and_pooled(encoders["clip_g"],
                                                   self.padded("clip_g", prompts))
            clip = torch.cat([h_l, h_g], dim=-1)                           # (P, 77, Dl + Dg)
            if "t5" in self.spec.encoder_names:
                t5 = t5_hidden(encoders["t5"], self.padded("t5", prompts)).to(clip.dtype)
            else:                       # no T5 in the checkpoint: zeros, as the pipeline
                t5 = torch.zeros(len(prompts), self.t5_window, self.joint_attention_dim,
                                 dtype=clip.dtype, device=clip.device)
            clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
            embeds = torch.cat([clip, t5], dim=-2)                         # (P, 77 + L5, D)
            pooled = torch.cat([pooled_l, pooled_g], dim=-1)               # (P, Pl + Pg)
        return Condition({"prompt_embeds": embeds, "pooled": pooled})


class SD3Denoiser:
    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        if media:
            raise InvalidRequestError("SD3 takes no media inputs", field="media", expected=[],
                                      actual=sorted(media))
        return models["transformer"](hidden_states=state, timestep=model_time,
                                     encoder_hidden_states=cond["prompt_embeds"],
                                     pooled_projections=cond["pooled"], return_dict=False)[0]


class SD3Codec(OneLatentCodec):
    latent_name, label = 'image_latent', 'SD3'

    def __init__(self, vae: ImageVAE, channels: int, patch_size: int):
        self.vae, self.channels, self.patch_size = vae, channels, patch_size

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        f = self.vae.scale_factor
        self.vae.check_size(sampling.height, sampling.width, f * self.patch_size, "SD3")
        if sampling.num_frames != 1:
            raise InvalidRequestError("SD3 generates single images", field="sampling.num_frames",
                                      expected=1, actual=sampling.num_frames)
        return (self.channels, sampling.height // f, sampling.width // f)

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        self.check_latent(latent_name, latent, sampling)
        return self.vae.decode(modules["vae"], latent)


class SD3Family(CheckpointFamily):
    """StableDiffusion3Pipeline checkpoints (SD3-medium, SD3.5-medium / large / turbo)."""

    entry_name = "sd3"

    def __init__(self, root: str | Path, options: Mapping | SD3Options | None = None):
        super().__init__(root, options)
        index = self.index
        transformer = read_json(self.root, "transformer", "config.json")
        self.schedule = FlowSchedule(self.root)
        vae = ImageVAE(self.root)
        clip_len = tokenizer_max_length(self.root, "tokenizer")
        vocab = lambda component: encoder_vocab_size(self.root, component)   # noqa: E731
        encoders = [EncoderSpec("clip_l", "text_encoder", "tokenizer", clip_len,
                                Overflow.TRUNCATE, CLIP_ETP_PLAN, vocab("text_encoder")),
                    EncoderSpec("clip_g", "text_encoder_2", "tokenizer_2",
                                tokenizer_max_length(self.root, "tokenizer_2"),
                                Overflow.TRUNCATE, CLIP_ETP_PLAN, vocab("text_encoder_2"))]
        if index.get("text_encoder_3") and index["text_encoder_3"][0] is not None:
            encoders.append(EncoderSpec("t5", "text_encoder_3", "tokenizer_3",
                                        self.options.max_sequence_length, Overflow.REJECT,
                                        T5_ETP_PLAN, vocab("text_encoder_3")))
        side = int(transformer.get("sample_size", 128)) * vae.scale_factor
        self.spec = FamilySpec(
            name="sd3", io_spec=image_io_spec(Layout.LATENT_CHW), tasks={Task.T2I: ()},
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=SD3_GUIDANCE, transformers=("transformer",),
            lora_targets={"transformer": SD3_LORA_TARGETS}, encoders=tuple(encoders),
            decoders={"image_latent": ("vae",)},
            sampling_defaults={"height": side, "width": side, "num_frames": 1})
        self.conditioner = SD3Conditioner(self.spec, self.root,
                                          int(transformer["joint_attention_dim"]),
                                          self.options.max_sequence_length)
        self.denoiser = SD3Denoiser()
        self.patch_size = int(transformer.get("patch_size", 2))
        self.codec = SD3Codec(vae, int(transformer["in_channels"]), self.patch_size)

    def _seq_len(self, sampling: SamplingSpec) -> int:
        _, h, w = self.codec.state_shape(sampling)
        return (h // self.patch_size) * (w // self.patch_size)

    def sigmas(self, sampling: SamplingSpec) -> torch.Tensor:
        return self.schedule.sigmas(sampling.num_steps, self._seq_len(sampling))

    def schedule_shift(self, sampling: SamplingSpec) -> float:
        return self.schedule.static_shift(self._seq_len(sampling))
