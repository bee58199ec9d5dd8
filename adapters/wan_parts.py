"""Pieces of the Wan 2.1 / 2.2 families (adapters/wan.py): the UMT5 conditioner, the Wan VAE's
latent normalisation and decode, the image-to-video condition, and the schedule a checkpoint's
scheduler config gives.

Each reproduces one step of diffusers 0.42.1's `pipelines/wan/pipeline_wan.py` /
`pipeline_wan_i2v.py` (file:line in docs/MODEL_FAMILIES.md):
  text       prompt_clean (ftfy, double HTML unescape, whitespace) BEFORE tokenizing, so the ids
             are those the pipeline's encoder sees; UMT5 with the attention mask; the states past
             each prompt's length zeroed; padded to the window (max_sequence_length)
  latents    (B, z, (F-1)/4 + 1, H/8, W/8) normalised as z_dit = (z - mean) * (1 / std)
  I2V        first frame in [-1, 1] followed by F-1 zero frames, VAE-encoded (posterior mode),
             normalised; 4 mask channels (1 on the first latent frame); CLIP image features =
             the penultimate hidden states of the image encoder on the image processor's input
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from adapters.checkpoint import read_json
from adapters.diffusers_parts import FLOW_SCHEDULER, TokenizingConditioner
from adapters.family import EncoderSpec, unit_to_uint8
from contract import Condition, ConfigError, PromptBundle

UNIPC_SCHEDULER = "UniPCMultistepScheduler"


def prompt_clean(text: str) -> str:
    """The Wan pipelines' own prompt cleaning (diffusers' function, ftfy when installed)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as clean
    return clean(text)


class UMT5Conditioner(TokenizingConditioner):
    """One UMT5 encoder ("umt5"): prompts cleaned as the pipeline cleans them, then tokenized;
    condition `prompt_embeds` (P, window, D), zero past each prompt's ids."""

    def tokenize_one(self, encoder: EncoderSpec, text: str,
                     field: str) -> tuple[tuple[int, ...], bool]:
        return super().tokenize_one(encoder, prompt_clean(text), field)

    def encode(self, encoders: Mapping[str, nn.Module],
               prompts: Sequence[PromptBundle]) -> Condition:
        encoder = encoders["umt5"]
        ids = self.padded("umt5", prompts)                                 # (P, L)
        lengths = torch.tensor([len(p.token_ids) for p in prompts])
        mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]     # the tokenizer's mask
        device = next(encoder.parameters()).device
        with torch.no_grad():
            hidden = encoder(ids.to(device), mask.long().to(device)).last_hidden_state
            hidden = torch.where(mask.to(device)[..., None], hidden, torch.zeros_like(hidden))
        return Condition({"prompt_embeds": hidden})


# ---- VAE ------------------------------------------------------------------------------------
_VAE_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.Lock]" = weakref.WeakKeyDictionary()
_VAE_LOCKS_GUARD = threading.Lock()


@contextmanager
def exclusive(vae: nn.Module):
    """One encode / decode at a time per AutoencoderKLWan module: it keeps its causal-conv
    feature cache on the module (clear_cache / _feat_map), so calls from two threads (a decoder
    replica decodes requests concurrently) interleave into wrong frames and frame counts."""
    with _VAE_LOCKS_GUARD:
        lock = _VAE_LOCKS.setdefault(vae, threading.Lock())
    with lock:
        yield


class WanVAE:
    """AutoencoderKLWan latents in the DiT's space, z_dit = (z - mean) * (1 / std), per channel
    (`latents_mean` / `latents_std` of the VAE config), and the compression the sizes obey."""

    def __init__(self, root: Path, subfolder: str = "vae"):
        config = read_json(root, subfolder, "config.json")
        self.z_dim = int(config["z_dim"])
        self.mean = torch.tensor(config["latents_mean"]).view(1, self.z_dim, 1, 1, 1)
        self.inv_std = 1.0 / torch.tensor(config["latents_std"]).view(1, self.z_dim, 1, 1, 1)
        # AutoencoderKLWan's defaults when a config predates the keys (Wan 2.1: 8x, 4x)
        self.spatial = int(config.get("scale_factor_spatial", 8))
        self.temporal = int(config.get("scale_factor_temporal", 4))

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.temporal + 1

    @torch.no_grad()
    def decode(self, vae: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """DiT-space latent (B, z, T', h, w) -> uint8 video (B, F, 3, H, W), as the pipeline
        denormalises and VideoProcessor postprocesses (x / 2 + 0.5 clamped, * 255, rounded)."""
        param = next(vae.parameters())
        z = latent.to(param.device, param.dtype)
        z = z / self.inv_std.to(z.device, z.dtype) + self.mean.to(z.device, z.dtype)
        with exclusive(vae):
            video = vae.decode(z, return_dict=False)[0].float()            # (B, 3, F, H, W)
        return unit_to_uint8(video).permute(0, 2, 1, 3, 4).cpu()

    @torch.no_grad()
    def encode_first_frame(self, vae: nn.Module, image: torch.Tensor,
                           num_frames: int) -> torch.Tensor:
        """uint8 (3, H, W) -> the I2V condition (1, 4 + z, T', h, w): the frame mask channels
        and the normalised posterior mode of [first frame, F - 1 zero frames]."""
        param = next(vae.parameters())
        pixels = image.float() / 255.0 * 2.0 - 1.0                         # as VaeImageProcessor
        _, height, width = pixels.shape
        video = torch.cat([pixels[None, :, None],
                           pixels.new_zeros(1, 3, num_frames - 1, height, width)], dim=2)
        with exclusive(vae):
            posterior = vae.encode(video.to(param.device, param.dtype)).latent_dist
        z = posterior.mode().float().cpu()
        z = (z - self.mean) * self.inv_std
        return torch.cat([self.first_frame_mask(num_frames, z.shape[-2], z.shape[-1]), z], dim=1)

    def first_frame_mask(self, num_frames: int, rows: int, cols: int) -> torch.Tensor:
        """(1, temporal, T', h, w): pixel frame mask (first frame 1), the first frame repeated
        `temporal` times, folded into `temporal` channels per latent frame."""
        mask = torch.zeros(1, 1, num_frames, rows, cols)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(self.temporal, dim=2), mask[:, :, 1:]],
                         dim=2)
        return mask.view(1, -1, self.temporal, rows, cols).transpose(1, 2)


@torch.no_grad()
def clip_image_embeds(processor, encoder: nn.Module, image: torch.Tensor) -> torch.Tensor:
    """uint8 (3, H, W) -> (1, N, D): the image encoder's penultimate hidden states on the
    checkpoint's image processor output (the pipeline's encode_image, on the same PIL image)."""
    from PIL import Image
    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
    param = next(encoder.parameters())
    out = encoder(pixel_values=pixels.to(param.device, param.dtype), output_hidden_states=True)
    return out.hidden_states[-2].float().cpu()


# ---- schedule -------------------------------------------------------------------------------
class UniPCHandling(str, Enum):
    """What a Wan family does with a checkpoint whose scheduler is UniPCMultistepScheduler (the
    published Wan `-Diffusers` checkpoints ship it; the project samples with flow-matching
    Euler / SDE steps, not UniPC's multistep predictor-corrector)."""

    REFUSE = "refuse"                  # ConfigError naming the scheduler and this option
    FLOW_EULER = "flow_euler"          # FlowMatchEuler with UniPC's flow_shift on UniPC's
    #                                    spacing: UniPC's own sigma table, stepped by Euler / SDE


def schedule_config(root: Path, unipc: UniPCHandling) -> tuple[dict, bool]:
    """(a FlowMatchEulerDiscreteScheduler config, whether sigmas use UniPC's spacing) for the
    checkpoint's scheduler. A FlowMatchEuler checkpoint is used as is (the pipeline calls
    set_timesteps(n)); a UniPC flow-prediction one only when `unipc` says FLOW_EULER."""
    config = read_json(root, "scheduler", "scheduler_config.json")
    name = config.get("_class_name")
    if name == FLOW_SCHEDULER:
        return config, False
    if name != UNIPC_SCHEDULER:
        raise ConfigError("the Wan families sample with a FlowMatchEulerDiscreteScheduler "
                          "(or a UniPC flow-prediction) scheduler config", field="scheduler",
                          expected=[FLOW_SCHEDULER, UNIPC_SCHEDULER], actual=name)
    if unipc is UniPCHandling.REFUSE:
        raise ConfigError("the checkpoint's scheduler is UniPCMultistepScheduler; the project "
                          "steps with flow-matching Euler / SDE. Set adapter option "
                          "unipc: flow_euler to sample UniPC's sigma table (its flow_shift) "
                          "with Euler steps (the result is not UniPC's)",
                          field="rollout.adapter_options.unipc", expected="flow_euler",
                          actual=UniPCHandling.REFUSE.value)
    unsupported = {k: config.get(k) for k in ("use_karras_sigmas", "use_exponential_sigmas",
                                              "use_beta_sigmas") if config.get(k)}
    if config.get("prediction_type") != "flow_prediction" or not config.get("use_flow_sigmas") \
            or config.get("final_sigmas_type", "zero") != "zero" or unsupported:
        raise ConfigError("only a UniPC flow-prediction config with flow sigmas ending at 0 maps "
                          "to a flow-matching Euler schedule", field="scheduler",
                          expected={"prediction_type": "flow_prediction",
                                    "use_flow_sigmas": True, "final_sigmas_type": "zero"},
                          actual={k: config.get(k) for k in (
                              "prediction_type", "use_flow_sigmas", "final_sigmas_type")}
                          | unsupported)
    return {"_class_name": FLOW_SCHEDULER,
            "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
            "shift": float(config.get("flow_shift", 1.0)),
            "use_dynamic_shifting": bool(config.get("use_dynamic_shifting", False)),
            "time_shift_type": config.get("time_shift_type", "exponential"),
            "shift_terminal": config.get("shift_terminal")}, True


def unipc_spacing(num_steps: int, num_train_timesteps: int) -> list[float]:
    """UniPC's unshifted flow sigmas: linspace(1, 1 / N_train, n + 1) without the last."""
    return list(np.linspace(1.0, 1.0 / num_train_timesteps, num_steps + 1)[:-1])
