"""Rule-based verifier for synthetic shape images (synthetic/shapes.py): real image analysis.

Per image (uint8 (3, H, W)) and its caption:
  background  border-ring median colour -> soft nearest background palette colour;
  foreground  pixels whose L2 distance from that median is > FOREGROUND_DISTANCE, minus
              speckle (fewer than 3 foreground pixels in the 3x3 neighbourhood);
  color       mean foreground colour -> soft nearest shape palette colour;
  position    foreground centroid -> soft nearest position anchor;
  shape       (bbox fill ratio, fraction of mass in the lower half of the bbox) -> soft nearest
              prototype (square (1, .5), circle (pi/4, .5), triangle (.5, .75)).
Soft score of the prompted class = softmax(-d^2 / tau) over the class prototypes, so an exact
render scores ~1 and a different class ~0. An image with no foreground pixels has no shape:
color/shape/position score 0 (a real verdict about the image, not a failure substitute).
total (primary) = mean of the attributes the scorer targets (`attributes`; default all four).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from contract import (ConfigError, InvalidRequestError, Modality, ScorerOutput, ScoreStatus,
                      UnscorableInputError)
from rewards.base import ScoreRequest
from rewards.media import require_decoded
from synthetic.shapes import (BACKGROUND_RGB, BACKGROUNDS, COLOR_RGB, COLORS, POSITION_ANCHORS,
                              POSITIONS, SHAPES, ImageSpec, Shape, parse_caption)

FOREGROUND_DISTANCE = 60.0      # RGB L2; palette foreground/background pairs are >= 120 apart
MIN_FOREGROUND_FRACTION = 0.01  # fewer foreground pixels than this = no shape drawn
ATTRIBUTES = ("color", "shape", "position", "background")
SCORE_NAMES = (*ATTRIBUTES, "total")

# Shape features (fill ratio of bbox, lower-half mass fraction) of the ideal shapes.
SHAPE_PROTOTYPES: dict[Shape, tuple[float, float]] = {
    Shape.SQUARE: (1.0, 0.5),
    Shape.CIRCLE: (math.pi / 4, 0.5),
    Shape.TRIANGLE: (0.5, 0.75),
}
TAU_COLOR = 1500.0       # RGB distance^2 scale (palette colours are >= 140 apart)
TAU_SHAPE = 0.004        # feature distance^2 scale (closest prototypes are ~0.21 apart)
TAU_POSITION = 0.01      # (fraction of image size)^2 scale (anchors are >= 0.31 apart)


@dataclass(frozen=True)
class ImageAnalysis:
    """What the rules measured in one image."""

    background_rgb: tuple[float, float, float]
    foreground_fraction: float
    foreground_rgb: tuple[float, float, float] | None
    centroid: tuple[float, float] | None      # (x, y) as fractions of (W, H)
    fill_ratio: float | None
    lower_mass: float | None


def _soft_match(value: torch.Tensor, prototypes: torch.Tensor, target: int, tau: float) -> float:
    """Probability of prototype `target` under softmax(-|value - p|^2 / tau). value: (D,), p: (K, D)."""
    d2 = ((prototypes - value[None]) ** 2).sum(dim=-1)          # (K,)
    return float(torch.softmax(-d2 / tau, dim=0)[target])


def analyze(image: torch.Tensor) -> ImageAnalysis:
    """Measure one uint8 (3, H, W) image."""
    img = image.to(torch.float32)                                # (3, H, W)
    _, h, w = img.shape
    border = torch.cat([img[:, 0, :], img[:, -1, :], img[:, :, 0], img[:, :, -1]], dim=1)
    bg = border.median(dim=1).values                             # (3,)
    dist = (img - bg[:, None, None]).norm(dim=0)                 # (H, W)
    raw = dist > FOREGROUND_DISTANCE
    # Drop speckle: keep a pixel only if >= 3 pixels of its 3x3 neighbourhood are foreground
    # (shape corners and a triangle's apex have >= 3, isolated noise pixels do not).
    support = torch.nn.functional.avg_pool2d(raw[None, None].float(), 3, stride=1, padding=1,
                                             count_include_pad=True)[0, 0] * 9
    mask = raw & (support >= 2.5)
    fraction = float(mask.float().mean())
    bg_rgb = tuple(float(v) for v in bg)
    if fraction < MIN_FOREGROUND_FRACTION:
        return ImageAnalysis(bg_rgb, fraction, None, None, None, None)
    fg = img[:, mask].mean(dim=1)                                # (3,)
    ys, xs = torch.nonzero(mask, as_tuple=True)
    cx, cy = (xs.float() + 0.5).mean() / w, (ys.float() + 0.5).mean() / h
    y0, y1, x0, x1 = int(ys.min()), int(ys.max()), int(xs.min()), int(xs.max())
    box = mask[y0:y1 + 1, x0:x1 + 1]                             # (bh, bw)
    fill = float(box.float().mean())
    bh = box.shape[0]
    lower = box[bh // 2:] if bh % 2 == 0 else box[bh // 2 + 1:]  # rows strictly below the middle
    upper = box[:bh // 2]
    lower_mass = float(lower.sum()) / max(float(lower.sum() + upper.sum()), 1.0)
    return ImageAnalysis(bg_rgb, fraction, tuple(float(v) for v in fg), (float(cx), float(cy)),
                         fill, lower_mass)


def score_image(image: torch.Tensor, spec: ImageSpec,
                attributes: tuple[str, ...] = ATTRIBUTES) -> dict[str, float]:
    """Named scores in [0, 1] of one uint8 (3, H, W) image against the attributes of `spec`;
    total = the mean of `attributes`."""
    a = analyze(image)
    bg_palette = torch.tensor([BACKGROUND_RGB[b] for b in BACKGROUNDS], dtype=torch.float32)
    scores = {"background": _soft_match(torch.tensor(a.background_rgb), bg_palette,
                                        BACKGROUNDS.index(spec.background), TAU_COLOR)}
    if a.foreground_rgb is None:
        scores.update(color=0.0, shape=0.0, position=0.0)
    else:
        color_palette = torch.tensor([COLOR_RGB[c] for c in COLORS], dtype=torch.float32)
        anchors = torch.tensor([POSITION_ANCHORS[p] for p in POSITIONS], dtype=torch.float32)
        shape_protos = torch.tensor([SHAPE_PROTOTYPES[s] for s in SHAPES], dtype=torch.float32)
        scores["color"] = _soft_match(torch.tensor(a.foreground_rgb), color_palette,
                                      COLORS.index(spec.color), TAU_COLOR)
        scores["position"] = _soft_match(torch.tensor(a.centroid), anchors,
                                         POSITIONS.index(spec.position), TAU_POSITION)
        scores["shape"] = _soft_match(torch.tensor([a.fill_ratio, a.lower_mass]), shape_protos,
                                      SHAPES.index(spec.shape), TAU_SHAPE)
    scores["total"] = sum(scores[name] for name in attributes) / len(attributes)
    return scores


class ImageAttributeScorer:
    """Scorer protocol: decoded `image` artifact + shape captions -> color/shape/position/
    background/total scores; total = the mean of `attributes` (the ones the reward targets; all
    four are still reported). A caption outside the vocabulary is the client's input the scorer
    cannot read: UnscorableInputError, from `check_prompt` (the ingress runs it first) or
    `score`."""

    name = "image_attributes"
    primary = "total"

    def __init__(self, artifact: str = "image",
                 attributes: list[str] | tuple[str, ...] = ATTRIBUTES):
        if (isinstance(attributes, str) or not attributes
                or any(a not in ATTRIBUTES for a in attributes)
                or len(set(attributes)) != len(attributes)):
            raise ConfigError("image_attributes scores a non-empty set of its attributes",
                              field="image_attributes.params.attributes",
                              expected=f"distinct names from {list(ATTRIBUTES)}",
                              actual=attributes)
        self.required_artifacts = (artifact,)
        self.attributes = tuple(attributes)

    def check_prompt(self, text: str) -> None:
        """rewards.base.ChecksPrompts: the caption must parse (synthetic/shapes.py grammar)."""
        try:
            parse_caption(text)
        except InvalidRequestError as err:
            raise UnscorableInputError(err.message, field=err.field, expected=err.expected,
                                       actual=err.actual) from None

    def score(self, request: ScoreRequest) -> ScorerOutput:
        artifact = require_decoded(request.artifacts, self.required_artifacts[0], Modality.IMAGE,
                                   self.name)
        images = artifact.data                                   # (B, 3, H, W) uint8
        if images.shape[1] != 3:
            raise InvalidRequestError(f"scorer {self.name!r} needs RGB images",
                                      field=f"{self.name}.artifacts.{artifact.name}.shape",
                                      expected="(B, 3, H, W)", actual=tuple(images.shape))
        if len(request.prompts) != images.shape[0]:
            raise InvalidRequestError(f"scorer {self.name!r} needs one prompt per image",
                                      field=f"{self.name}.prompts", expected=images.shape[0],
                                      actual=len(request.prompts))
        specs = []
        for i, prompt in enumerate(request.prompts):
            try:
                specs.append(parse_caption(prompt))
            except InvalidRequestError as err:
                raise UnscorableInputError(err.message, field=f"{self.name}.prompts[{i}]."
                                           f"{err.field}", expected=err.expected,
                                           actual=err.actual) from err
        rows = [score_image(img, spec, self.attributes) for img, spec in zip(images, specs)]
        scores = {name: tuple(row[name] for row in rows) for name in SCORE_NAMES}
        return ScorerOutput(scorer=self.name, scores=scores,
                            status=tuple(ScoreStatus.OK for _ in rows),
                            reasons=tuple(None for _ in rows))
