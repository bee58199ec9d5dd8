"""The embedded default text->image family: MiniLM text encoder + toy SD3 DiT + toy KL VAE.

Text: the pretrained all-MiniLM-L6-v2 (adapters/minilm.py), frozen, one encoder "minilm".
DiT: diffusers `SD3Transformer2DModel` at toy size on a 4x8x8 latent; flow matching in the
project convention (x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0), model time = 1000 sigma.
VAE: diffusers `AutoencoderKL` 32x32 RGB <-> 4x8x8; the DiT sees (z - shift_factor) *
scaling_factor, both stored in the VAE config by scripts/pretrain_t2i.py.
Weights: adapters/weights/tiny_t2i/{transformer,vae}/ (diffusers safetensors + config.json) and
adapter.json (this family's own settings); any local directory with that layout loads the same.
Components: "text_encoder" (MiniLM), "transformer", "vae".
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from adapters.embedded import EMBEDDED_GUIDANCE, EmbeddedFamily
from adapters.family import FamilySpec, OneLatentCodec
from adapters.lora_targets import LoRATarget, LoRATargetMap
from adapters.minilm import ENCODER, PACKAGE, MiniLMConditioner, minilm_encoder_spec
from contract import (ArtifactSpec, Condition, InvalidRequestError,
                      IOSpec, Layout, Modality, Representation, SamplingSpec, Task,
                      TimeConvention)

SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tiny_t2i"
SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                    "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj")


class TinyT2IConfig(BaseModel):
    """Settings that are not in the diffusers configs (stored as adapter.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size: int = Field(32, description="Trained resolution (height = width) in pixels.")
    vae_downsample: int = Field(4, description="Pixel size / latent size.")
    latent_channels: int = 4
    max_text_tokens: int = Field(32, description="Fixed padded prompt length (incl. CLS/SEP).")
    text_encoder: str = Field(PACKAGE, description="Bundled encoder package, or a local "
                              "transformers directory.")


def default_transformer_config() -> dict:
    """Toy SD3 DiT: 64 latent tokens (patch 1 on 8x8), inner dim 96, 4 joint blocks."""
    return dict(sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=4,
                attention_head_dim=32, num_attention_heads=3, joint_attention_dim=384,
                caption_projection_dim=96, pooled_projection_dim=384, pos_embed_max_size=8)


def default_vae_config() -> dict:
    """Toy KL VAE: 3 levels (32 -> 16 -> 8), 4 latent channels."""
    return dict(in_channels=3, out_channels=3, latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 3,
                up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                layers_per_block=1, norm_num_groups=8, sample_size=32,
                scaling_factor=1.0, shift_factor=0.0, mid_block_add_attention=False)


def image_to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) in [0, 255] -> float (B, 3, H, W) in [-1, 1]."""
    return images.to(torch.float32) / 127.5 - 1.0


def unit_to_image(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) in [-1, 1] (clamped) -> uint8 (B, 3, H, W)."""
    return ((x.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)


def vae_encode(vae: AutoencoderKL, images: torch.Tensor, sample: bool = False,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> DiT-space latent (B, C, h, w) = (z - shift) * scale."""
    param = next(vae.parameters())
    dist = vae.encode(image_to_unit(images).to(param.device, param.dtype)).latent_dist
    z = dist.sample(generator) if sample else dist.mode()
    return (z.float() - vae.config.shift_factor) * vae.config.scaling_factor


def vae_decode(vae: AutoencoderKL, latent: torch.Tensor) -> torch.Tensor:
    """DiT-space latent (B, C, h, w) -> uint8 (B, 3, H, W) (decoded in the VAE's dtype)."""
    param = next(vae.parameters())
    z = latent.float() / vae.config.scaling_factor + vae.config.shift_factor
    return unit_to_image(vae.decode(z.to(param.device, param.dtype)).sample.float()).cpu()


class SD3StyleDenoiser:
    """Forward of a diffusers SD3Transformer2DModel on one image latent (NOISE_LEVEL, 1000 sigma)."""

    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0

    def forward(self, models, state, sigma, model_time, cond: Condition, media, guidance):
        if media:
            raise InvalidRequestError("this family takes no media inputs", field="media",
                                      expected=[], actual=sorted(media))
        return models["transformer"](hidden_states=state, encoder_hidden_states=cond["hidden"],
                                     pooled_projections=cond["pooled"], timestep=model_time,
                                     return_dict=False)[0]


class TinyT2ICodec(OneLatentCodec):
    latent_name, label = 'image_latent', 'tiny_t2i'

    def __init__(self, config: TinyT2IConfig):
        self.config = config

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        size = self.config.image_size
        for name in ("height", "width"):
            if getattr(sampling, name) != size:
                raise InvalidRequestError(f"tiny_t2i generates {size}x{size} images only",
                                          field=f"sampling.{name}", expected=size,
                                          actual=getattr(sampling, name))
        if sampling.num_frames != 1:
            raise InvalidRequestError("tiny_t2i generates single images",
                                      field="sampling.num_frames", expected=1,
                                      actual=sampling.num_frames)
        side = size // self.config.vae_downsample
        return (self.config.latent_channels, side, side)

    def decode(self, latent_name: str, modules: Mapping[str, nn.Module], latent: torch.Tensor,
               sampling: SamplingSpec):
        self.check_latent_name(latent_name)
        with torch.no_grad():
            return vae_decode(modules["vae"], latent)                       # (B, 3, H, W) u8


class TinyT2IFamily(EmbeddedFamily):
    """Text -> 32x32 RGB image (Task.T2I)."""

    components = {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL}
    config_cls = TinyT2IConfig
    shipped = SHIPPED_WEIGHTS
    # the packed layout of the vLLM-Omni engine (fused q/k/v, fc1 in 2 shards ordered (1, 0))
    packed_lora_map = LoRATargetMap(
        targets=(
            LoRATarget("attn.to_q", "attn.to_qkv", 0, 3),
            LoRATarget("attn.to_k", "attn.to_qkv", 1, 3),
            LoRATarget("attn.to_v", "attn.to_qkv", 2, 3),
            LoRATarget("attn.add_q_proj", "attn.to_added_qkv", 0, 3),
            LoRATarget("attn.add_k_proj", "attn.to_added_qkv", 1, 3),
            LoRATarget("attn.add_v_proj", "attn.to_added_qkv", 2, 3),
            LoRATarget("attn.to_out.0", "attn.to_out.0"),
            LoRATarget("attn.to_add_out", "attn.to_add_out"),
        ),
        fc1_train_suffix="ff.net.0.proj", fc1_infer_suffix="ff.net.0.proj",
        fc1_shards=2, fc1_shard_order=(1, 0))

    def set_config(self, config: TinyT2IConfig) -> None:
        self.config = config
        self.spec = FamilySpec(
            name="tiny_t2i",
            io_spec=IOSpec(
                artifacts=(
                    ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT,
                                 Layout.LATENT_CHW),
                    ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                                 source="image_latent"),
                ),
                defaults=("image_latent", "image")),
            tasks={Task.T2I: ()},
            time_convention=TimeConvention.NOISE_LEVEL, model_time_scale=1000.0,
            guidance=EMBEDDED_GUIDANCE,
            transformers=("transformer",),
            lora_targets={"transformer": SD3_LORA_TARGETS},
            encoders=(minilm_encoder_spec(config.max_text_tokens, config.text_encoder),),
            decoders={"image_latent": ("vae",)},
            sampling_defaults={"height": config.image_size, "width": config.image_size,
                               "num_frames": 1})
        self.conditioner = MiniLMConditioner(self.spec, config.text_encoder)
        self.denoiser = SD3StyleDenoiser()
        self.codec = TinyT2ICodec(config)

    def build(self, transformer_config: Mapping | None = None,
              vae_config: Mapping | None = None, seed: int = 0) -> dict[str, nn.Module]:
        """Freshly initialised transformer and VAE (the starting point of pretraining)."""
        torch.manual_seed(seed)
        return {"transformer": SD3Transformer2DModel(
                    **(transformer_config or default_transformer_config())).eval(),
                "vae": AutoencoderKL(**(vae_config or default_vae_config())).eval()}


__all__ = ["ENCODER", "SHIPPED_WEIGHTS", "SD3StyleDenoiser", "TinyT2IConfig", "TinyT2IFamily",
           "default_transformer_config", "default_vae_config", "image_to_unit", "unit_to_image",
           "vae_decode", "vae_encode"]
