"""Pieces the diffusers-checkpoint families share: token windows, CLIP / T5 encoding exactly as
the pipelines run them, the flow-matching schedule from the checkpoint's own scheduler, and the
2-D image VAE codec (latents <-> pixels with the VAE's scale and shift).

Every function here reproduces one step of a diffusers pipeline (file:line references in
docs/MODEL_FAMILIES.md), so a family built from them samples as its pipeline does.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from adapters.checkpoint import load_component, read_json
from adapters.family import Conditioner, EncoderSpec, ETPPlan, Overflow, unit_to_uint8
from contract import ConfigError, InvalidRequestError, LimitExceededError, PromptBundle

CLIP_ETP_PLAN = ETPPlan(
    layers="text_model.encoder.layers",
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"),
    row=("self_attn.out_proj", "mlp.fc2"),
    vocab="text_model.embeddings.token_embedding", heads="num_attention_heads")

# CLIPTextModel (FLUX's CLIP-L) has no `text_model.` level in transformers 5, unlike
# CLIPTextModelWithProjection (SD3's two CLIPs)
CLIP_TEXT_MODEL_ETP_PLAN = dataclasses.replace(CLIP_ETP_PLAN, layers="encoder.layers",
                                               vocab="embeddings.token_embedding")

T5_ETP_PLAN = ETPPlan(
    layers="encoder.block",
    column=("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
            "layer.0.SelfAttention.relative_attention_bias", "layer.1.DenseReluDense.wi_0",
            "layer.1.DenseReluDense.wi_1"),
    row=("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo"),
    vocab="shared", heads="num_heads",
    local_heads=("layer.0.SelfAttention.n_heads", "layer.0.SelfAttention.inner_dim"))

# UMT5 (Wan's text encoder) has T5's module names; unlike T5, whose first layer alone holds the
# relative position bias, every UMT5 layer carries its own `relative_attention_bias` (buckets x
# heads), which the same plan column-splits by heads in every layer.
UMT5_ETP_PLAN = T5_ETP_PLAN

# The Qwen-VL language model (Qwen2.5-VL, Qwen3-VL), Megatron-split by heads: q / k / v and the
# gated MLP's gate / up column-parallel, o / down row-parallel, the token embedding
# vocab-parallel. Grouped-query attention: etp must divide the key/value heads (then it divides
# the query heads too). Its vision tower is not in the plan: the families replicate it.
QWEN_VL_ETP_PLAN = ETPPlan(
    layers="model.language_model.layers",
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    vocab="model.language_model.embed_tokens", heads="num_key_value_heads")


def tokenizer_max_length(root: Path, subfolder: str, default: int = 77) -> int:
    """A tokenizer's model_max_length from its tokenizer_config.json (no tokenizer loaded)."""
    path = root / subfolder / "tokenizer_config.json"
    if not path.is_file():
        return default
    value = read_json(root, subfolder, "tokenizer_config.json").get("model_max_length", default)
    return int(value) if isinstance(value, (int, float)) and value < 1e9 else default


def encoder_vocab_size(root: Path, component: str) -> int | None:
    """The text encoder's vocabulary size from its config.json (nested text_config too)."""
    if not (root / component / "config.json").is_file():
        return None
    config = read_json(root, component, "config.json")
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if isinstance(size, int) else None


class TokenizingConditioner(Conditioner):
    """Tokenization with the checkpoint's own tokenizers (loaded on first use), one per encoder,
    and padding to each encoder's window exactly as `padding="max_length"` pads."""

    def __init__(self, spec, root: Path):
        super().__init__(spec)
        self.root = Path(root)
        self._tokenizers: dict[str, object] = {}

    def tokenizer(self, encoder: EncoderSpec):
        if encoder.name not in self._tokenizers:
            self._tokenizers[encoder.name] = load_component(self.root, encoder.tokenizer)
        return self._tokenizers[encoder.name]

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        tok = self.tokenizer(encoder)
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if len(ids) <= encoder.max_length:
            return tuple(ids), False
        if encoder.overflow is Overflow.TRUNCATE:    # the pipeline's truncation=True, recorded
            return tuple(tok(text, truncation=True, max_length=encoder.max_length,
                             add_special_tokens=True)["input_ids"]), True
        raise LimitExceededError("prompt is longer than the encoder window", field=field,
                                 expected=f"<= {encoder.max_length} {encoder.name} tokens",
                                 actual=len(ids))

    def padded(self, name: str, prompts: Sequence[PromptBundle]) -> torch.Tensor:
        """(P, window) long: each prompt's ids for `name`, right-padded with the pad id."""
        encoder = self.spec.encoder(name)
        pad = self.tokenizer(encoder).pad_token_id
        if pad is None:
            raise ConfigError("the tokenizer has no pad token", field=f"{encoder.tokenizer}",
                              actual=None)
        out = torch.full((len(prompts), encoder.max_length), int(pad), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids = prompt.ids_by_encoder(self.spec.encoder_names)[name]
            if len(ids) > encoder.max_length:
                raise LimitExceededError("prompt ids are longer than the encoder window",
                                         field=f"prompts[{i}].{name}",
                                         expected=f"<= {encoder.max_length}", actual=len(ids))
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def clip_hidden_and_pooled(encoder: nn.Module, ids: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3's CLIP call: (penultimate hidden states (P, L, D), projected pooled output (P, E))."""
    out = encoder(ids.to(_device_of(encoder)), output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def clip_pooled(encoder: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """FLUX's CLIP call: the pooled output (P, D) of CLIPTextModel."""
    return encoder(ids.to(_device_of(encoder)), output_hidden_states=False).pooler_output


def t5_hidden(encoder: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """T5 encoder states (P, L, D); the pipelines pass no attention mask."""
    return encoder(ids.to(_device_of(encoder)))[0]


# ---- schedule --------------------------------------------------------------------------------
FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"


class FlowSchedule:
    """The checkpoint's FlowMatchEulerDiscreteScheduler, used only to compute sigma tables."""

    # calculate_shift's defaults where the scheduler config leaves a key out (the pipeline's
    # own: SD3 / FLUX / Wan; a family whose pipeline uses others overrides them)
    shift_defaults = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                      "max_shift": 1.15}

    def __init__(self, root: Path, config: Mapping | None = None):
        """`config`: a FlowMatchEulerDiscreteScheduler config a family derived from the
        checkpoint's own (Wan from a UniPC config), instead of scheduler_config.json."""
        self.config = dict(config) if config is not None else \
            read_json(root, "scheduler", "scheduler_config.json")
        name = self.config.get("_class_name")
        if name != FLOW_SCHEDULER:
            raise ConfigError("the project samples flow-matching checkpoints with their "
                              "FlowMatchEulerDiscreteScheduler config", field="scheduler",
                              expected=FLOW_SCHEDULER, actual=name)

    @property
    def dynamic(self) -> bool:
        return bool(self.config.get("use_dynamic_shifting"))

    def mu(self, image_seq_len: int) -> float:
        """Resolution-dependent shift (the pipelines' calculate_shift: linear in seq length)."""
        c = {key: self.config.get(key, default) for key, default in self.shift_defaults.items()}
        base_len, max_len = c["base_image_seq_len"], c["max_image_seq_len"]
        base_shift, max_shift = c["base_shift"], c["max_shift"]
        m = (max_shift - base_shift) / (max_len - base_len)
        return image_seq_len * m + (base_shift - m * base_len)

    def sigmas(self, num_steps: int, image_seq_len: int,
               custom: Sequence[float] | None = None) -> torch.Tensor:
        """(num_steps + 1,) fp32, exactly the scheduler's `sigmas` after set_timesteps."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.config)
        kwargs = {"mu": self.mu(image_seq_len)} if self.dynamic else {}
        if custom is not None:              # retrieve_timesteps(..., sigmas=...) calls it so
            scheduler.set_timesteps(sigmas=list(custom), **kwargs)
        else:
            scheduler.set_timesteps(num_steps, **kwargs)
        return scheduler.sigmas.to(torch.float32).cpu()

    def scheduler_at(self, sigmas: torch.Tensor):
        """A fresh scheduler whose table is exactly `sigmas` (N+1,), ready to `step`."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.config)
        scheduler.sigmas = sigmas.clone()
        scheduler.timesteps = sigmas[:-1] * scheduler.config.num_train_timesteps
        scheduler.num_inference_steps = int(sigmas.shape[0]) - 1
        scheduler._step_index, scheduler._begin_index = None, 0
        return scheduler

    def static_shift(self, image_seq_len: int) -> float:
        """The static shift equal to this schedule's (exp(mu) for the exponential dynamic one)."""
        if self.dynamic:
            if self.config.get("time_shift_type", "exponential") != "exponential":
                raise ConfigError("only the exponential dynamic shift has a static equivalent",
                                  field="scheduler.time_shift_type",
                                  actual=self.config.get("time_shift_type"))
            return math.exp(self.mu(image_seq_len))
        return float(self.config.get("shift", 1.0))


# ---- 2-D image VAE -----------------------------------------------------------------------------
class ImageVAE:
    """AutoencoderKL latents in the DiT's space: z_dit = (z - shift_factor) * scaling_factor."""

    def __init__(self, root: Path, subfolder: str = "vae"):
        config = read_json(root, subfolder, "config.json")
        self.subfolder = subfolder
        self.scaling_factor = float(config.get("scaling_factor", 1.0))
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        self.scale_factor = 2 ** (len(config.get("block_out_channels", (1,))) - 1)
        self.latent_channels = int(config.get("latent_channels", 4))

    @torch.no_grad()
    def decode(self, vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """DiT-space latent (B, C, h, w) -> uint8 (B, 3, H, W), as VaeImageProcessor
        postprocesses (x / 2 + 0.5 clamped to [0, 1], * 255, rounded)."""
        param = next(vae.parameters())
        z = latent.float() / self.scaling_factor + self.shift_factor
        image = vae.decode(z.to(param.device, param.dtype), return_dict=False)[0]
        return unit_to_uint8(image).cpu()

    @torch.no_grad()
    def encode(self, vae: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, H, W) -> DiT-space latent (B, C, h, w) (the posterior mode)."""
        param = next(vae.parameters())
        x = images.float() / 127.5 - 1.0
        z = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode().float()
        return (z - self.shift_factor) * self.scaling_factor

    def check_size(self, height: int, width: int, multiple: int, family: str) -> None:
        for name, value in (("height", height), ("width", width)):
            if value % multiple:
                raise InvalidRequestError(f"{family} generates sizes divisible by {multiple} "
                                          "(VAE x patch); nothing is resized",
                                          field=f"sampling.{name}",
                                          expected=f"a multiple of {multiple}", actual=value)


def modules_named(modules: Mapping[str, nn.Module], names: Sequence[str]) -> list[nn.Module]:
    missing = [n for n in names if n not in modules]
    if missing:
        raise InvalidRequestError("the conditioner needs these encoders", field="encoders",
                                  expected=list(names), actual=sorted(modules))
    return [modules[n] for n in names]
