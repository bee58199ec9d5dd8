"""A config-only SD3.5-medium checkpoint folder: the published diffusers configs, no weights.

`write_skeleton(root, transformer_config)` writes what `adapters.sd3.SD3Family` reads before any
weight is loaded -- model_index.json, transformer/config.json, vae/config.json,
scheduler/scheduler_config.json and the tokenizers' tokenizer_config.json (their windows) -- so
the family's spec, denoiser and sigma tables are exactly those of the published checkpoint, and
the transformer can be built from its config with random weights (speed does not depend on
weights). The text encoders are not written: the GPU check feeds random conditions of their
real shapes.

Values: stabilityai/stable-diffusion-3.5-medium as published for diffusers (transformer: 24
layers, 24 heads x 64, joint_attention_dim 4096, caption_projection_dim 1536, pooled 2048,
patch 2, 16 latent channels, pos_embed_max_size 384, dual attention in layers 0-12, qk RMSNorm;
VAE: 16-channel AutoencoderKL, scaling 1.5305, shift 0.0609; scheduler: flow matching, static
shift 3.0).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

SD35_MEDIUM_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16,
    "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
    "joint_attention_dim": 4096, "caption_projection_dim": 1536, "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384, "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}

# The tests' tiny SD3.5 layout (scripts/tiny_checkpoints.py): the same blocks (qk RMSNorm, a
# dual-attention layer, patch 2, 16 channels) at a size a CPU runs in milliseconds.
TINY_SD35_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 8, "patch_size": 2, "in_channels": 16, "out_channels": 16,
    "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 4,
    "joint_attention_dim": 96, "caption_projection_dim": 32, "pooled_projection_dim": 80,
    "pos_embed_max_size": 16, "dual_attention_layers": [0], "qk_norm": "rms_norm",
}

SD35_MEDIUM_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
    "act_fn": "silu", "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609,
    "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False,
}

SD35_SCHEDULER: dict[str, Any] = {"_class_name": "FlowMatchEulerDiscreteScheduler",
                                  "num_train_timesteps": 1000, "shift": 3.0}

SD35_MODEL_INDEX: dict[str, Any] = {
    "_class_name": "StableDiffusion3Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "tokenizer_3": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "image_encoder": [None, None], "feature_extractor": [None, None],
}

SD35_TOKENIZERS: dict[str, dict[str, Any]] = {
    "tokenizer": {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77},
    "tokenizer_2": {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77},
    "tokenizer_3": {"tokenizer_class": "T5Tokenizer", "model_max_length": 512},
}


def _write(path: Path, config: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_skeleton(root: str | Path,
                   transformer: Mapping[str, Any] = SD35_MEDIUM_TRANSFORMER) -> Path:
    """Write the config-only checkpoint folder at `root` (created) and return it."""
    root = Path(root)
    _write(root / "model_index.json", SD35_MODEL_INDEX)
    _write(root / "transformer" / "config.json", transformer)
    _write(root / "vae" / "config.json", SD35_MEDIUM_VAE)
    _write(root / "scheduler" / "scheduler_config.json", SD35_SCHEDULER)
    for subfolder, config in SD35_TOKENIZERS.items():
        _write(root / subfolder / "tokenizer_config.json", config)
    return root
