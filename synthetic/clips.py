"""Seeded synthetic audio-video clips: a coloured square bounces off the walls; every bounce rings.

A clip is 8 frames at 8 fps (1 s) of 32x32 RGB plus 1 s of 16 kHz mono audio. The square moves at
constant speed along one axis and reflects at the walls; at each wall contact a short decaying tone
burst starts, whose pitch encodes the square's colour (red 440 Hz, green 660, blue 880, yellow 1100).
Captions name colour, motion axis and sound, and parse back exactly (`parse_caption`).

Everything is rendered on the fly from a frozen `ClipSpec`; the ground truth a verifier needs (the
frame index of each bounce, the tone pitch) comes with the render.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from contract.errors import InvalidRequestError
from synthetic.shapes import COLOR_RGB, Color   # one colour vocabulary for images and clips

NUM_FRAMES = 8
FPS = 8.0
SIZE = 32
SAMPLE_RATE = 16000
SQUARE = 6                      # side of the square in pixels
BACKGROUND = (24, 24, 24)
BURST_SECONDS = 0.06            # tone burst length
BURST_DECAY = 0.02              # exponential envelope time constant (s)
BURST_AMPLITUDE = 0.6


class Motion(str, Enum):
    HORIZONTAL = "left and right"
    VERTICAL = "up and down"


# Palette (uint8 RGB, shared with synthetic.shapes) and the pitch each colour sounds at (Hz).
RGB: dict[Color, tuple[int, int, int]] = dict(COLOR_RGB)
PITCH_HZ: dict[Color, float] = {Color.RED: 440.0, Color.GREEN: 660.0, Color.BLUE: 880.0,
                                Color.YELLOW: 1100.0}
# Sound phrase per colour (the caption's description of the pitch).
SOUND: dict[Color, str] = {Color.RED: "low beeps", Color.GREEN: "mid beeps",
                           Color.BLUE: "high beeps", Color.YELLOW: "very high beeps"}


@dataclass(frozen=True)
class ClipSpec:
    """One clip. pos0: start offset along the motion axis (pixels, in [0, SIZE - SQUARE]);
    speed: signed pixels per frame; cross: fixed offset on the other axis."""

    color: Color
    motion: Motion
    pos0: float
    speed: float
    cross: int

    @property
    def pitch_hz(self) -> float:
        return PITCH_HZ[self.color]


@dataclass(frozen=True)
class RenderedClip:
    video: np.ndarray           # (T, 3, H, W) uint8
    audio: np.ndarray           # (C=1, N) float32 in [-1, 1]
    fps: float
    sample_rate: int
    bounce_frames: tuple[int, ...]   # frame index nearest to each wall contact
    bounce_times: tuple[float, ...]  # contact times in seconds

    def __iter__(self):  # allows `video, audio, fps, sr, bounces = render(spec)`
        return iter((self.video, self.audio, self.fps, self.sample_rate, self.bounce_frames))


def _reflect(x: float, span: float) -> float:
    """Fold x into [0, span] by mirror reflection (a triangle wave of period 2*span)."""
    m = math.fmod(x, 2 * span)
    m = m + 2 * span if m < 0 else m
    return m if m <= span else 2 * span - m


def positions(spec: ClipSpec) -> np.ndarray:
    """Square offset along the motion axis at each frame: (T,) float."""
    span = SIZE - SQUARE
    return np.array([_reflect(spec.pos0 + spec.speed * t, span) for t in range(NUM_FRAMES)])


def contact_times(spec: ClipSpec) -> list[float]:
    """Times (in frames, 0 <= tc <= T-1) at which the square touches a wall."""
    span = SIZE - SQUARE
    out = []
    # unfolded coordinate u(t) = pos0 + speed*t hits a wall whenever u is a multiple of span
    u0, u1 = spec.pos0, spec.pos0 + spec.speed * (NUM_FRAMES - 1)
    lo, hi = sorted((u0, u1))
    for k in range(math.ceil(lo / span), math.floor(hi / span) + 1):
        tc = (k * span - spec.pos0) / spec.speed
        if 0 < tc < NUM_FRAMES - 1:
            out.append(tc)
    return sorted(out)


def render(spec: ClipSpec) -> RenderedClip:
    """Draw the clip. Returns video (T,3,H,W) uint8, audio (1,N) float32, fps, sample rate, bounces."""
    video = np.empty((NUM_FRAMES, 3, SIZE, SIZE), dtype=np.uint8)
    video[:] = np.array(BACKGROUND, dtype=np.uint8)[None, :, None, None]
    rgb = np.array(RGB[spec.color], dtype=np.uint8)[:, None, None]
    for t, p in enumerate(positions(spec)):
        a = int(round(p))
        if spec.motion == Motion.HORIZONTAL:
            video[t, :, spec.cross:spec.cross + SQUARE, a:a + SQUARE] = rgb
        else:
            video[t, :, a:a + SQUARE, spec.cross:spec.cross + SQUARE] = rgb
    n = int(round(NUM_FRAMES / FPS * SAMPLE_RATE))
    audio = np.zeros(n, dtype=np.float64)
    burst_n = int(BURST_SECONDS * SAMPLE_RATE)
    tt = np.arange(burst_n) / SAMPLE_RATE
    burst = BURST_AMPLITUDE * np.exp(-tt / BURST_DECAY) * np.sin(2 * np.pi * spec.pitch_hz * tt)
    times = contact_times(spec)
    for tc in times:
        start = int(round(tc / FPS * SAMPLE_RATE))
        seg = audio[start:start + burst_n]
        seg += burst[:seg.shape[0]]
    return RenderedClip(video=video, audio=audio[None].astype(np.float32), fps=FPS,
                        sample_rate=SAMPLE_RATE, bounce_frames=tuple(int(round(t)) for t in times),
                        bounce_times=tuple(t / FPS for t in times))


def sample_specs(n: int, seed: int) -> list[ClipSpec]:
    """n seeded specs, each with 1-2 bounces at frames 1..T-2 at least 2 frames apart, each
    contact within 0.3 frames of a frame time."""
    if n < 1:
        raise InvalidRequestError("need at least one clip", field="n", expected=">= 1", actual=n)
    rng = np.random.default_rng(seed)
    colors, motions = list(Color), list(Motion)
    out: list[ClipSpec] = []
    while len(out) < n:
        spec = ClipSpec(color=colors[rng.integers(len(colors))],
                        motion=motions[rng.integers(len(motions))],
                        pos0=float(rng.uniform(0, SIZE - SQUARE)),
                        speed=float(rng.choice([-1, 1]) * rng.uniform(5.0, 8.0)),
                        cross=int(rng.integers(2, SIZE - SQUARE - 1)))
        times = contact_times(spec)
        frames = [int(round(t)) for t in times]
        if any(abs(t - round(t)) > 0.3 for t in times):   # keep the nearest frame unambiguous
            continue
        if not frames or frames[0] < 1 or frames[-1] > NUM_FRAMES - 2:
            continue
        if any(b - a < 2 for a, b in zip(frames, frames[1:])):
            continue
        out.append(spec)
    return out


def caption(spec: ClipSpec) -> str:
    return f"a {spec.color.value} square bouncing {spec.motion.value} with {SOUND[spec.color]}"


@dataclass(frozen=True)
class ParsedCaption:
    color: Color
    motion: Motion
    sound_color: Color          # the colour whose pitch the sound phrase names

    @property
    def pitch_hz(self) -> float:
        return PITCH_HZ[self.sound_color]


def parse_caption(text: str) -> ParsedCaption:
    """Inverse of `caption`. Raises InvalidRequestError naming the part that does not parse."""
    rest = text.strip().lower()

    def take(prefix: str, part: str) -> None:
        nonlocal rest
        if not rest.startswith(prefix):
            raise InvalidRequestError(f"caption does not parse at the {part}", field=f"caption.{part}",
                                      expected=prefix, actual=rest or text)
        rest = rest[len(prefix):]

    def choose(options: dict[str, object], part: str) -> object:
        nonlocal rest
        for word in sorted(options, key=len, reverse=True):  # longest first ("very high" > "high")
            if rest.startswith(word):
                rest = rest[len(word):]
                return options[word]
        raise InvalidRequestError(f"caption does not parse at the {part}", field=f"caption.{part}",
                                  expected=sorted(options), actual=rest or text)

    take("a ", "article")
    color = choose({c.value: c for c in Color}, "color")
    take(" square bouncing ", "object")
    motion = choose({m.value: m for m in Motion}, "motion")
    take(" with ", "sound")
    sound = choose({v: c for c, v in SOUND.items()}, "sound")
    if rest.strip():
        raise InvalidRequestError("caption has trailing text", field="caption.trailing",
                                  expected="", actual=rest)
    return ParsedCaption(color=color, motion=motion, sound_color=sound)  # type: ignore[arg-type]
