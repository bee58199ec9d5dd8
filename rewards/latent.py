"""A reward read from the latent itself (verl-omni's latent rewards): no VAE decode is needed,
so a graph whose scorers all read latents and whose caller asks for no decoded media runs no
decoder at all (deployments/ingress.py plans decodes from the requested names and the scorers'
decoded inputs only).

LatentHeadScorer: a two-layer head on the latent's per-channel mean over every other axis,
    h = gelu(W1 mean(z) + b1),   reward = w2 . h + b2
with W1 (H, C), b1 (H,), w2 (1, H), b2 (1,) read from a safetensors file (`proj.weight`,
`proj.bias`, `out.weight`, `out.bias`), fp32. A head whose C is not the latent's channel count,
a missing or mis-shaped tensor, or a decoded artifact where a latent belongs is a typed error.
"""
from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import (ConfigError, MediaFormatError, Representation, ScorerOutput,
                      validate_artifact)
from contract.errors import MissingArtifactError
from rewards.base import ScoreRequest
from rewards.embedding import ok_output

HEAD_KEYS = ("proj.weight", "proj.bias", "out.weight", "out.bias")


class LatentHeadScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "latent_head"
    head_path: str = Field(description="safetensors file: proj.weight (H, C), proj.bias (H,), "
                                       "out.weight (1, H), out.bias (1,)")
    artifact: str = Field("image_latent", description="the latent artifact it reads")


def load_head(path: str, field: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise ConfigError("latent head file not found", field=field, actual=path)
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"not a safetensors file: {e}", field=field, actual=path) from None
    missing = [k for k in HEAD_KEYS if k not in tensors]
    if missing:
        raise ConfigError("latent head lacks tensors", field=field, expected=list(HEAD_KEYS),
                          actual=sorted(tensors))
    hidden, _ = tensors["proj.weight"].shape
    shapes = {"proj.bias": (hidden,), "out.weight": (1, hidden), "out.bias": (1,)}
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ConfigError(f"latent head tensor {key} has the wrong shape",
                              field=f"{field}.{key}", expected=shape,
                              actual=tuple(tensors[key].shape))
    return {k: tensors[k].float() for k in HEAD_KEYS}


class LatentHeadScorer:
    primary = "latent_reward"

    def __init__(self, config: LatentHeadScorerConfig):
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        self._head = load_head(config.head_path, f"{self.name}.head_path")

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        name, field = self.config.artifact, f"{self.name}.artifacts.{self.config.artifact}"
        if name not in request.artifacts:
            raise MissingArtifactError(f"scorer {self.name!r} needs artifact {name!r}",
                                       field=field, expected=name,
                                       actual=sorted(request.artifacts))
        art = request.artifacts[name]
        if art.spec.representation != Representation.LATENT:
            raise MediaFormatError(f"scorer {self.name!r} reads a latent, got decoded media",
                                   field=f"{field}.representation", expected="latent",
                                   actual=art.spec.representation.value)
        validate_artifact(art)
        head = self._head
        channels = head["proj.weight"].shape[1]
        if art.data.shape[1] != channels:
            raise MediaFormatError(f"scorer {self.name!r}: the head reads {channels} latent "
                                   "channels", field=f"{field}.shape", expected=channels,
                                   actual=tuple(art.data.shape))
        pooled = art.data.float().flatten(2).mean(-1)                      # (B, C)
        hidden = torch.nn.functional.gelu(pooled @ head["proj.weight"].T + head["proj.bias"])
        reward = (hidden @ head["out.weight"].T + head["out.bias"])[:, 0]
        return ok_output(self.name, {"latent_reward": reward})
