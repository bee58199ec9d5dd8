"""Synthetic verifiable text->image data: one coloured shape at a named position on a background.

Every image is a pure function of its `ImageSpec` (no global RNG), and every caption parses back to
the spec's attributes, so a rule-based verifier can score a generated image against its prompt.
Vocabulary (kept small so a tiny model can learn it): 3 shapes x 4 colours x 5 positions x 3
backgrounds = 180 attribute combinations. `Split.EVAL` holds out 30 of them (the first 30 of a
permutation seeded with `SPLIT_SEED`) so evaluation prompts are unseen compositions that still
cover every value of every attribute; `Split.TRAIN` holds the other 150.

Geometry, for size S (default 32): a shape of side `extent` (10 or 12 px at S=32) centred at its
position's anchor (`POSITION_ANCHORS`, fractions of S) plus an integer `offset` jitter of at most
1 px. Anchors keep every shape >= 1 px away from the image border, so the border shows background.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from enum import Enum

import torch

from contract.errors import InvalidRequestError


class Shape(str, Enum):
    CIRCLE = "circle"
    SQUARE = "square"
    TRIANGLE = "triangle"


class Color(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"
    YELLOW = "yellow"


class Position(str, Enum):
    TOP_LEFT = "top left"
    TOP_RIGHT = "top right"
    BOTTOM_LEFT = "bottom left"
    BOTTOM_RIGHT = "bottom right"
    CENTER = "center"


class Background(str, Enum):
    BLACK = "black"
    WHITE = "white"
    GRAY = "gray"


class Split(str, Enum):
    TRAIN = "train"
    EVAL = "eval"


# RGB values; shape colours are >= 120 (L2) away from every background colour.
COLOR_RGB: dict[Color, tuple[int, int, int]] = {
    Color.RED: (220, 40, 40),
    Color.GREEN: (40, 180, 60),
    Color.BLUE: (50, 80, 220),
    Color.YELLOW: (230, 210, 40),
}
BACKGROUND_RGB: dict[Background, tuple[int, int, int]] = {
    Background.BLACK: (0, 0, 0),
    Background.WHITE: (255, 255, 255),
    Background.GRAY: (128, 128, 128),
}
# Shape centre as (x, y) fractions of the image size.
POSITION_ANCHORS: dict[Position, tuple[float, float]] = {
    Position.TOP_LEFT: (9 / 32, 9 / 32),
    Position.TOP_RIGHT: (23 / 32, 9 / 32),
    Position.BOTTOM_LEFT: (9 / 32, 23 / 32),
    Position.BOTTOM_RIGHT: (23 / 32, 23 / 32),
    Position.CENTER: (16 / 32, 16 / 32),
}
EXTENTS: tuple[int, ...] = (10, 12)     # shape side in px at size 32
MAX_OFFSET = 1                          # jitter in px at size 32, per axis

SHAPES: tuple[Shape, ...] = tuple(Shape)
COLORS: tuple[Color, ...] = tuple(Color)
POSITIONS: tuple[Position, ...] = tuple(Position)
BACKGROUNDS: tuple[Background, ...] = tuple(Background)


@dataclass(frozen=True)
class ImageSpec:
    """One image. `extent` (px at size 32) and `offset` (dx, dy px at size 32) are not captioned."""

    shape: Shape
    color: Color
    position: Position
    background: Background
    extent: int = 12
    offset: tuple[int, int] = (0, 0)

    @property
    def attributes(self) -> tuple[Shape, Color, Position, Background]:
        """What the caption states (the verifiable part)."""
        return (self.shape, self.color, self.position, self.background)


ALL_COMBINATIONS: tuple[tuple[Shape, Color, Position, Background], ...] = tuple(
    itertools.product(SHAPES, COLORS, POSITIONS, BACKGROUNDS))
NUM_EVAL_COMBINATIONS = 30
SPLIT_SEED = 20240611   # fixed: changing it changes which prompts are held out
_SPLIT_ORDER = torch.randperm(len(ALL_COMBINATIONS),
                              generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
EVAL_COMBINATIONS: frozenset[tuple[Shape, Color, Position, Background]] = frozenset(
    ALL_COMBINATIONS[i] for i in _SPLIT_ORDER[:NUM_EVAL_COMBINATIONS])
TRAIN_COMBINATIONS: tuple[tuple[Shape, Color, Position, Background], ...] = tuple(
    c for c in ALL_COMBINATIONS if c not in EVAL_COMBINATIONS)


def split_combinations(split: Split) -> tuple[tuple[Shape, Color, Position, Background], ...]:
    """The attribute combinations of a split, in a fixed order."""
    if split == Split.TRAIN:
        return TRAIN_COMBINATIONS
    return tuple(c for c in ALL_COMBINATIONS if c in EVAL_COMBINATIONS)


def sample_specs(n: int, seed: int, split: Split = Split.TRAIN) -> list[ImageSpec]:
    """n specs drawn uniformly from the split's combinations with random extent and jitter."""
    if n < 0:
        raise InvalidRequestError("n must be >= 0", field="n", expected=">= 0", actual=n)
    combos = split_combinations(Split(split))
    gen = torch.Generator().manual_seed(int(seed))
    idx = torch.randint(len(combos), (n,), generator=gen).tolist()
    ext = torch.randint(len(EXTENTS), (n,), generator=gen).tolist()
    off = torch.randint(-MAX_OFFSET, MAX_OFFSET + 1, (n, 2), generator=gen).tolist()
    return [ImageSpec(*combos[i], extent=EXTENTS[e], offset=(o[0], o[1]))
            for i, e, o in zip(idx, ext, off)]


def _shape_mask(shape: Shape, size: int, cx: float, cy: float, side: float) -> torch.Tensor:
    """Boolean (size, size) mask of a shape with bounding box side `side` centred at (cx, cy)."""
    coords = torch.arange(size, dtype=torch.float32) + 0.5           # pixel centres
    y, x = torch.meshgrid(coords, coords, indexing="ij")              # (H, W) each
    half = side / 2
    if shape == Shape.SQUARE:
        return ((x - cx).abs() <= half) & ((y - cy).abs() <= half)
    if shape == Shape.CIRCLE:
        return (x - cx) ** 2 + (y - cy) ** 2 <= half ** 2
    # Triangle pointing up: apex at the top centre, base along the bottom of the box.
    top, bottom = cy - half, cy + half
    frac = (y - top) / side                                           # 0 at apex, 1 at base
    return (y >= top) & (y <= bottom) & ((x - cx).abs() <= half * frac)


def render(spec: ImageSpec, size: int = 32) -> torch.Tensor:
    """uint8 (3, size, size) image of `spec`."""
    if size < 16:
        raise InvalidRequestError("render size must be >= 16", field="size", expected=">= 16",
                                  actual=size)
    scale = size / 32
    ax, ay = POSITION_ANCHORS[spec.position]
    cx, cy = ax * size + spec.offset[0] * scale, ay * size + spec.offset[1] * scale
    mask = _shape_mask(spec.shape, size, cx, cy, spec.extent * scale)          # (H, W)
    bg = torch.tensor(BACKGROUND_RGB[spec.background], dtype=torch.uint8)[:, None, None]
    fg = torch.tensor(COLOR_RGB[spec.color], dtype=torch.uint8)[:, None, None]
    return torch.where(mask[None], fg, bg).contiguous()                         # (3, H, W)


def render_batch(specs: list[ImageSpec], size: int = 32) -> torch.Tensor:
    """uint8 (B, 3, size, size)."""
    return torch.stack([render(s, size) for s in specs])


def _position_phrase(position: Position) -> str:
    return "in the center" if position == Position.CENTER else f"at the {position.value}"


def caption(spec: ImageSpec) -> str:
    """E.g. 'a red circle at the top left on a black background'."""
    return (f"a {spec.color.value} {spec.shape.value} {_position_phrase(spec.position)} "
            f"on a {spec.background.value} background")


def _alternatives(values) -> str:
    return "|".join(re.escape(v) for v in values)


_POSITION_PHRASES = {_position_phrase(p): p for p in POSITIONS}
_CAPTION_PARTS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("article", r"an? ", {}),
    ("color", rf"({_alternatives(c.value for c in COLORS)}) ", {c.value: c for c in COLORS}),
    ("shape", rf"({_alternatives(s.value for s in SHAPES)}) ", {s.value: s for s in SHAPES}),
    ("position", rf"({_alternatives(_POSITION_PHRASES)}) ", _POSITION_PHRASES),
    ("background", rf"on an? ({_alternatives(b.value for b in BACKGROUNDS)}) background$",
     {b.value: b for b in BACKGROUNDS}),
)


def parse_caption(text: str) -> ImageSpec:
    """Inverse of `caption` (case and surrounding whitespace ignored; extent/offset default).

    Raises InvalidRequestError naming the part that failed to parse and the remaining text.
    """
    rest = " ".join(str(text).strip().lower().split())
    found: dict[str, object] = {}
    for part, pattern, lookup in _CAPTION_PARTS:
        match = re.match(pattern, rest)
        if match is None:
            expected = sorted(lookup) if lookup else ["a", "an"]
            raise InvalidRequestError(f"caption part {part!r} not understood in {text!r}",
                                      field=f"caption.{part}", expected=expected, actual=rest)
        if lookup:
            found[part] = lookup[match.group(1)]
        rest = rest[match.end():]
    return ImageSpec(shape=found["shape"], color=found["color"], position=found["position"],
                     background=found["background"])
