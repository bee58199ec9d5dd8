"""OCR reward for text rendering (Flow-GRPO's OCR reward) with RapidOCR's shipped PP-OCRv4 models.

Per sample, with the target text T from the prompt's metadata (key `target_key`) and the text R
recognised in the image (every detected line with confidence >= `min_confidence`, joined):
    t = normalise(T), r = normalise(R)          (spaces removed, lower-cased)
    d = 0 if t is a substring of r else levenshtein(r, t), then d = min(d, len(t))
    ocr = 1 - d / len(t)                        in [0, 1]
An image with no text scores exactly 0 (d = len(t)): that is the formula's value, not a fallback.
A sample without a target text, or with an empty one, is refused with UnscorableInputError (the
client's prompt lacks what the scorer needs: a 4xx) naming the sample; an optional scorer then
reports MISSING with that reason. It never scores 0.

The detection / recognition / angle models are ONNX files shipped inside `rapidocr-onnxruntime`
(PP-OCRv4 det + rec, mobile v2 cls; Apache-2.0); other local ONNX files can be named instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from contract import ConfigError, Modality, ScorerOutput, ScoreStatus, UnscorableInputError
from rewards.base import ScoreRequest
from rewards.media import require_decoded


class OcrScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "ocr"
    artifact: str = Field("image", description="decoded image artifact to read")
    target_key: str = Field("ocr_text", description="per-sample metadata key of the target text")
    min_confidence: float = Field(0.5, ge=0.0, le=1.0,
                                  description="recognised lines below this confidence are dropped")
    use_angle_cls: bool = Field(False, description="rotate upside-down lines (Flow-GRPO: off)")
    det_model_path: str | None = Field(None, description="local ONNX; None = the shipped PP-OCRv4")
    rec_model_path: str | None = None
    cls_model_path: str | None = None
    threads: int = Field(1, ge=1, description="onnxruntime intra-op threads")


def normalise_text(text: str) -> str:
    """Flow-GRPO's normalisation: drop spaces, lower-case."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_reward(recognised: str, target: str) -> tuple[float, int]:
    """(reward, clipped distance) of recognised text against a non-empty target (module doc)."""
    r, t = normalise_text(recognised), normalise_text(target)
    if not t:
        raise ValueError("target text is empty after normalisation")
    d = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1.0 - d / len(t), d


class OcrScorer:
    """Scorer protocol: decoded image (B, 3, H, W) uint8 + per-sample metadata with the target."""

    primary = "ocr"

    def __init__(self, config: OcrScorerConfig):
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise ConfigError("the OCR scorer needs the rapidocr-onnxruntime package",
                              field=f"{config.name}.package",
                              expected="pip install rapidocr-onnxruntime") from e
        kwargs: dict[str, Any] = {"intra_op_num_threads": config.threads,
                                  "inter_op_num_threads": 1, "text_score": config.min_confidence,
                                  "use_cls": config.use_angle_cls}
        for part in ("det", "rec", "cls"):
            path = getattr(config, f"{part}_model_path")
            if path is None:
                continue
            if not Path(path).is_file() or Path(path).suffix != ".onnx":
                raise ConfigError(f"{part} model must be a local .onnx file",
                                  field=f"{config.name}.{part}_model_path", actual=path)
            kwargs[f"{part}_model_path"] = path
        try:
            self._engine = RapidOCR(**kwargs)
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types for bad files
            raise ConfigError(f"could not load the OCR models: {type(e).__name__}: {e}",
                              field=f"{config.name}.models", actual=kwargs) from e

    def targets(self, metadata: Sequence[Mapping[str, Any]], batch: int) -> list[str]:
        """The target text of every sample, or a typed error naming the first sample without."""
        key = self.config.target_key
        if len(metadata) != batch:
            raise UnscorableInputError(f"scorer {self.name!r} reads its target text from "
                                       f"per-sample metadata[{key!r}]; got metadata for "
                                       f"{len(metadata)} of {batch} samples",
                                       field=f"{self.name}.metadata", expected=batch,
                                       actual=len(metadata))
        out = []
        for i, meta in enumerate(metadata):
            text = meta.get(key)
            if not isinstance(text, str) or not normalise_text(text):
                raise UnscorableInputError(f"scorer {self.name!r} needs a non-empty target text "
                                           f"in the prompt's metadata",
                                           field=f"metadata[{i}].{key}",
                                           expected="non-empty str", actual=text)
            out.append(text)
        return out

    def recognise(self, image_chw: np.ndarray) -> str:
        """(3, H, W) uint8 RGB -> the recognised lines joined (empty when none is found)."""
        bgr = np.ascontiguousarray(image_chw.transpose(1, 2, 0)[..., ::-1])
        lines, _ = self._engine(bgr)
        return "".join(text for _, text, _ in lines or ())

    def score(self, request: ScoreRequest) -> ScorerOutput:
        art = require_decoded(request.artifacts, self.config.artifact, Modality.IMAGE, self.name)
        targets = self.targets(request.metadata, art.batch_size)     # before any OCR work
        images = art.data.cpu().numpy()
        rewards, dists = [], []
        for image, target in zip(images, targets):
            reward, dist = ocr_reward(self.recognise(image), target)
            rewards.append(reward)
            dists.append(float(dist))
        batch = art.batch_size
        return ScorerOutput(scorer=self.name,
                            scores={"ocr": tuple(rewards), "edit_distance": tuple(dists)},
                            status=(ScoreStatus.OK,) * batch, reasons=(None,) * batch)
