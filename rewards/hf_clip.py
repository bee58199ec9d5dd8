"""PickScore and CLIPScore with transformers' CLIPModel + CLIPProcessor from local snapshots.

With e_img, e_txt the L2-normalised projected embeddings of the image and the prompt:
    PickScore (Kirstain et al. 2023):  pickscore = exp(logit_scale) * <e_img, e_txt>
    CLIPScore (Hessel et al. 2021):    clipscore = w * max(<e_img, e_txt>, 0), w = 2.5
Both also report the raw "cosine". Weights load from `model_dir` (PickScore_v1: a CLIPModel
snapshot) and the processor from `processor_dir` (PickScore ships none: its authors use the
processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K), both with local_files_only=True. Images go
through the processor (resize shortest side, centre crop, normalise) and prompts through its
tokenizer (padding, truncation at 77 tokens), as the reference inference code does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, ScorerOutput
from rewards.base import ScoreRequest
from rewards.embedding import ok_output, pooled_features
from rewards.media import image_prompt_chunks


class HFClipScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str | None = Field(None, description="default: the kind (pickscore / clipscore)")
    model_dir: str = Field(description="local transformers CLIPModel snapshot")
    processor_dir: str | None = Field(None, description="local CLIPProcessor dir; None = model_dir")
    artifact: str = Field("image", description="decoded image artifact to score")
    clipscore_weight: float = Field(2.5, gt=0, description="CLIPScore's w")
    max_text_tokens: int = Field(77, ge=1)
    max_batch: int = Field(32, ge=1, description="images per forward pass")
    device: str = "cpu"
    dtype: str = Field("float32", description="torch dtype of the weights (float32 / bfloat16 / "
                                              "float16)")


def torch_dtype(name: str, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError("unknown floating dtype", field=field, expected="float32 / bfloat16 / "
                          "float16", actual=name)
    return dtype


def check_snapshot(path: str, field: str, files: Sequence[str] = ("config.json",)) -> Path:
    p = Path(path)
    missing = [f for f in files if not (p / f).is_file()]
    if missing:
        raise ConfigError(f"not a transformers snapshot dir (missing {missing})", field=field,
                          actual=str(p))
    return p


def load_pretrained(cls, path: Path, field: str, dtype: torch.dtype):
    """cls.from_pretrained(local dir), refusing a checkpoint that leaves weights missing or
    mis-shaped (transformers would initialise those at random and only log it)."""
    try:
        model, info = cls.from_pretrained(str(path), local_files_only=True, dtype=dtype,
                                          output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"could not load {cls.__name__} from {path}: {e}", field=field,
                          actual=str(path)) from e
    bad = list(info.get("missing_keys", ())) + [str(m) for m in info.get("mismatched_keys", ())]
    if bad:
        raise ConfigError(f"{cls.__name__} checkpoint lacks weights", field=field,
                          expected="every weight of the architecture", actual=sorted(bad)[:8])
    return model


def load_clip_processor(path: str, field: str):
    from transformers import CLIPProcessor
    try:
        return CLIPProcessor.from_pretrained(str(check_snapshot(path, field, ())),
                                             local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"could not load a CLIPProcessor from {path}: {e}", field=field,
                          actual=path) from e


def images_to_pixels(processor, images: torch.Tensor, device: str,
                     dtype: torch.dtype) -> torch.Tensor:
    """(N, 3, H, W) uint8 -> the image processor's pixel_values (N, 3, S, S)."""
    arrays = list(np.ascontiguousarray(images.cpu().numpy().transpose(0, 2, 3, 1)))
    pixels = processor(images=arrays, return_tensors="pt")["pixel_values"]
    return pixels.to(device=device, dtype=dtype)


class _HFClipScorer:
    """Shared loading and embedding; subclasses define the score formula."""

    kind = ""

    def __init__(self, config: HFClipScorerConfig):
        from transformers import CLIPModel

        self.config = config
        self.name = config.name or self.kind
        self.required_artifacts = (config.artifact,)
        self._dtype = torch_dtype(config.dtype, f"{self.name}.dtype")
        path = check_snapshot(config.model_dir, f"{self.name}.model_dir")
        model = load_pretrained(CLIPModel, path, f"{self.name}.model_dir", self._dtype)
        self._model = model.to(config.device).eval().requires_grad_(False)
        self._processor = load_clip_processor(config.processor_dir or config.model_dir,
                                              f"{self.name}.processor_dir")
        vocab = len(self._processor.tokenizer)
        if vocab > model.config.text_config.vocab_size:
            raise ConfigError("tokenizer is larger than the text encoder's vocabulary",
                              field=f"{self.name}.processor_dir",
                              expected=f"<= {model.config.text_config.vocab_size}", actual=vocab)

    @torch.inference_mode()
    def cosines(self, request: ScoreRequest) -> tuple[torch.Tensor, int]:
        cfg = self.config
        out = []
        for images, prompts in image_prompt_chunks(request.artifacts, request.prompts,
                                                   cfg.artifact, self.name, cfg.max_batch):
            out.append((self.embed_images(images) * self.embed_texts(prompts)).sum(-1))
        return torch.cat(out), len(request.prompts)

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 -> (N, D) unit-norm float32."""
        pixels = images_to_pixels(self._processor, images, self.config.device, self._dtype)
        feats = pooled_features(self._model.get_image_features(pixel_values=pixels))
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    def embed_texts(self, prompts: Sequence[str]) -> torch.Tensor:
        tok = self._processor.tokenizer(list(prompts), padding=True, truncation=True,
                                        max_length=self.config.max_text_tokens,
                                        return_tensors="pt").to(self.config.device)
        feats = pooled_features(self._model.get_text_features(
            input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]))
        return torch.nn.functional.normalize(feats.float(), dim=-1)


class PickScoreScorer(_HFClipScorer):
    kind = "pickscore"
    primary = "pickscore"

    def score(self, request: ScoreRequest) -> ScorerOutput:
        cos, _ = self.cosines(request)
        scale = float(self._model.logit_scale.detach().float().exp())
        return ok_output(self.name, {"pickscore": scale * cos, "cosine": cos},
                         {"logit_scale": scale})


class ClipScoreScorer(_HFClipScorer):
    kind = "clipscore"
    primary = "clipscore"

    def score(self, request: ScoreRequest) -> ScorerOutput:
        cos, _ = self.cosines(request)
        return ok_output(self.name, {"clipscore": self.config.clipscore_weight * cos.clamp(min=0),
                                     "cosine": cos})
