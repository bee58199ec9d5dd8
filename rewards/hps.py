"""HPS v2 / v2.1 (Wu et al. 2023, Human Preference Score) on open_clip ViT-H-14.

    hps = <e_img, e_txt>    (L2-normalised open_clip embeddings; the diagonal of image @ text.T)
The checkpoint is HPS's own format: a torch file holding {"state_dict": <open_clip CLIP state
dict>} (HPS_v2_compressed.pt / HPS_v2.1_compressed.pt), loaded strictly into the open_clip
architecture `architecture` (ViT-H-14) built without pretrained weights; the tokenizer is
open_clip's CLIP BPE. Images: resize shortest side + centre crop to the model's size, OpenAI
mean / std (HPS's validation transform). `model_cfg` builds an architecture not in open_clip's
registry (tests use a tiny one).
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, ScorerOutput
from rewards.aesthetic import load_torch_file
from rewards.base import ScoreRequest
from rewards.embedding import CLIP_MEAN, CLIP_STD, ok_output, pixels_to_model
from rewards.media import image_prompt_chunks


class HPSv2ScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = "hpsv2"
    checkpoint: str = Field(description="HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt)")
    architecture: str = Field("ViT-H-14", description="open_clip architecture name")
    model_cfg: dict[str, Any] | None = Field(None, description="explicit open_clip CLIP kwargs")
    artifact: str = "image"
    max_batch: int = Field(32, ge=1)
    device: str = "cpu"


class HPSv2Scorer:
    primary = "hps"

    def __init__(self, config: HPSv2ScorerConfig):
        import open_clip

        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        field = f"{self.name}.checkpoint"
        ckpt = load_torch_file(config.checkpoint, field)
        if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
            raise ConfigError("not an HPS checkpoint (a dict with 'state_dict')", field=field,
                              expected=["state_dict"],
                              actual=sorted(ckpt)[:8] if isinstance(ckpt, dict)
                              else type(ckpt).__name__)
        try:
            if config.model_cfg is not None:
                model = open_clip.CLIP(**config.model_cfg)
                self._tokenizer = open_clip.SimpleTokenizer(
                    context_length=config.model_cfg["text_cfg"]["context_length"])
            else:
                model = open_clip.create_model(config.architecture, pretrained=None)
                self._tokenizer = open_clip.get_tokenizer(config.architecture)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"could not build open_clip {config.architecture!r}: {e}",
                              field=f"{self.name}.architecture", actual=config.architecture) from e
        try:
            model.load_state_dict(ckpt["state_dict"], strict=True)
        except RuntimeError as e:
            raise ConfigError(f"HPS checkpoint does not fit {config.architecture}: "
                              f"{str(e)[:400]}", field=field, actual=config.checkpoint) from e
        self._model = model.to(config.device).eval().requires_grad_(False)
        size = model.visual.image_size
        self._size = int(size if isinstance(size, int) else size[0])

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        out = []
        for images, prompts in image_prompt_chunks(request.artifacts, request.prompts,
                                                   cfg.artifact, self.name, cfg.max_batch):
            x = pixels_to_model(images, self._size, CLIP_MEAN, CLIP_STD).to(cfg.device)
            img = self._model.encode_image(x, normalize=True).float()
            tokens = self._tokenizer(list(prompts))
            txt = self._model.encode_text(tokens.to(cfg.device), normalize=True).float()
            out.append((img * txt).sum(-1))
        return ok_output(self.name, {"hps": torch.cat(out)})
