"""A config-only SD3.5-medium checkpoint folder: the published diffusers configs, no weights.

`write_skeleton(root, transformer_config)` writes what `adapters.sd3.SD3Family` reads before any
weight is loaded -- model_index.json, transformer/config.json, vae/config.json,
scheduler/scheduler_config.json and the tokenizers' tokenizer_config.json (their windows) -- so
the family's spec, denoiser and sigma tables are exactly those of the published checkpoint, and
the transformer can be built from its config with random weights (speed does not depend on
weights). The text encoders are not written: the GPU check feeds random conditions of their
real shapes.

Values: stabilityai/stable-diffusion-3.5-medium as published for diffusers, read from the shipped
description adapters/architectures/sd3.5-medium (transformer: 24 layers, 24 heads x 64, dual
attention in layers 0-12, qk RMSNorm; VAE: 16-channel AutoencoderKL, scaling 1.5305, shift
0.0609; scheduler: flow matching, static shift 3.0); the tokenizers' windows are written here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from adapters.architectures import architecture_root


def _described(rel: str) -> dict[str, Any]:
    return json.loads((architecture_root("sd3.5-medium") / rel).read_text())


# the published values, from the shipped description (adapters/architectures/sd3.5-medium)
SD35_MEDIUM_TRANSFORMER: dict[str, Any] = _described("transformer/config.json")

# The tests' tiny SD3.5 layout (testing/tiny_checkpoints.py): the same blocks (qk RMSNorm, a
# dual-attention layer, patch 2, 16 channels) at a size a CPU runs in milliseconds.
TINY_SD35_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 8, "patch_size": 2, "in_channels": 16, "out_channels": 16,
    "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 4,
    "joint_attention_dim": 96, "caption_projection_dim": 32, "pooled_projection_dim": 80,
    "pos_embed_max_size": 16, "dual_attention_layers": [0], "qk_norm": "rms_norm",
}

SD35_MEDIUM_VAE: dict[str, Any] = _described("vae/config.json")
SD35_SCHEDULER: dict[str, Any] = _described("scheduler/scheduler_config.json")
SD35_MODEL_INDEX: dict[str, Any] = _described("model_index.json")

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
