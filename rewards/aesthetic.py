"""LAION aesthetic predictor (improved-aesthetic-predictor, "sac+logos+ava1-l14-linearMSE").

    aesthetic = head( e / ||e|| ),   e = CLIP ViT-L/14 projected image embedding (768-d)
The head is the linear MLP of rewards/heads.py, loaded from its `.pth` state dict; the image
embedding comes from a local transformers CLIP snapshot (openai/clip-vit-large-patch14), of which
only the vision tower and its projection are loaded (CLIPVisionModelWithProjection), and its
image processor. Scores are on the predictor's 1-10 rating scale. The prompt is not read.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, Modality, ScorerOutput
from rewards.base import ScoreRequest
from rewards.embedding import ok_output
from rewards.heads import LinearMLPHead, load_mlp_head
from rewards.hf_clip import check_snapshot, images_to_pixels, load_pretrained, torch_dtype
from rewards.media import require_decoded


class AestheticScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = "aesthetic"
    clip_dir: str = Field(description="local CLIP ViT-L/14 snapshot (vision tower + processor)")
    head_path: str = Field(description="the MLP head .pth (a state dict)")
    artifact: str = "image"
    max_batch: int = Field(32, ge=1)
    device: str = "cpu"
    dtype: str = "float32"


def load_torch_file(path: str, field: str):
    """torch.load with weights_only=True (no code runs on load); typed errors for bad files.
    Zip-format files (torch.save since 1.6) are memory-mapped, so loading a state dict into a
    model does not hold a second copy of the weights in memory."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("checkpoint file not found", field=field, actual=path)
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(p))
    except Exception as e:  # noqa: BLE001 -- pickle / zip errors of a file in the wrong format
        raise ConfigError(f"not a torch checkpoint: {type(e).__name__}: {e}", field=field,
                          actual=path) from e


class AestheticScorer:
    primary = "aesthetic"

    def __init__(self, config: AestheticScorerConfig):
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        dtype = torch_dtype(config.dtype, f"{self.name}.dtype")
        path = check_snapshot(config.clip_dir, f"{self.name}.clip_dir")
        vision = load_pretrained(CLIPVisionModelWithProjection, path, f"{self.name}.clip_dir",
                                 dtype)
        try:
            self._processor = CLIPImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load the CLIP vision tower from {path}: {e}",
                              field=f"{self.name}.clip_dir", actual=str(path)) from e
        self._vision = vision.to(config.device).eval().requires_grad_(False)
        self._dtype = dtype
        state = load_torch_file(config.head_path, f"{self.name}.head_path")
        if not isinstance(state, dict):
            raise ConfigError("the head file must hold a state dict",
                              field=f"{self.name}.head_path",
                              actual=type(state).__name__)
        self._head: LinearMLPHead = load_mlp_head(state, vision.config.projection_dim,
                                                  f"{self.name}.head_path").to(config.device)

    @torch.inference_mode()
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 -> (N, D) L2-normalised float32 image embeddings."""
        pixels = images_to_pixels(self._processor, images, self.config.device, self._dtype)
        emb = self._vision(pixel_values=pixels).image_embeds.float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        art = require_decoded(request.artifacts, self.config.artifact, Modality.IMAGE, self.name)
        scores = [self._head(self.embed(chunk)) for chunk in art.data.split(self.config.max_batch)]
        return ok_output(self.name, {"aesthetic": torch.cat(scores)})
