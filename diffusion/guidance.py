"""Classifier-free guidance (Ho & Salimans 2022), in velocity space and in x0 space.

Velocity CFG:  v = v_u + g (v_c - v_u).
x0 CFG:        x0 = x0_u + g (x0_c - x0_u) with x0_* = x - sigma v_*, then v = (x - x0) / sigma.
Both are the same map (x0 is affine in v at fixed x, sigma); the x0 form is
what some video models apply, and the trainer must repeat exactly the sampling formula.
With several streams and guidance rescale (LTX-2) the x0 form is no longer the velocity form:
`GuidanceForm` declares which one a family uses (applied in diffusion/step.py only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from contract.enums import GuidanceKind
from contract.errors import ConfigError, InvalidRequestError
from diffusion._checks import check_float_tensor, check_row_sigma, check_same_shape, rows


# ---- the guidance decision a family declares -------------------------------------------------
# Which request scales run CFG is the family's pipeline's rule (FamilySpec.guidance), applied by
# diffusion/step.py `doubles_rows` only. A scale at which the pipeline runs the conditional branch
# alone runs it alone here too, and is recorded as the scale it ran at: 1.


class CFGRule(str, Enum):
    """When a true-CFG family runs the unconditional branch."""

    ABOVE_ONE = "above_one"    # scale > 1 (diffusers' `do_classifier_free_guidance`); at or
                               # below 1 the conditional branch alone
    NOT_ONE = "not_one"        # any scale but 1 (below 1 interpolates toward the unconditional)


@dataclass(frozen=True)
class GuidanceRule:
    """A family's guidance: its kind and, for true CFG, when the pipeline guides.

    kind: NONE (no guidance input: any scale but 1 is refused, naming sampling.guidance_scale),
    EMBEDDED (the scale is a model input, one forward, any scale), CFG (rows doubled with the
    unconditional prompt when `cfg` says so). stream_scales: fixed scales of other guided streams
    that turn CFG on by themselves when > 1 (LTX-2's audio_guidance_scale). source: the
    pipeline's rule, file:line, for errors and documentation."""

    kind: GuidanceKind
    cfg: CFGRule = CFGRule.ABOVE_ONE
    stream_scales: tuple[float, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidanceKind) or not isinstance(self.cfg, CFGRule):
            raise ConfigError("a guidance rule is a GuidanceKind and a CFGRule",
                              field="guidance", actual=(self.kind, self.cfg))
        if self.stream_scales and self.kind is not GuidanceKind.CFG:
            raise ConfigError("only true CFG has stream scales", field="guidance.stream_scales",
                              expected=(), actual=self.stream_scales)

    def guides(self, scale: float) -> bool:
        """Whether rows at this scale run the unconditional branch too (no refusal here)."""
        if self.kind is not GuidanceKind.CFG:
            return False
        if self.cfg is CFGRule.NOT_ONE:
            return scale != 1.0
        return scale > 1.0 or any(s > 1.0 for s in self.stream_scales)


def cfg_velocity(v_uncond: torch.Tensor, v_cond: torch.Tensor,
                 scale: float | torch.Tensor) -> torch.Tensor:
    """v_u + scale (v_c - v_u). v_uncond, v_cond: (B, *S); scale: a number or (B,) per row."""
    v_cond = check_float_tensor(v_cond, "v_cond")
    v_uncond = check_same_shape(v_uncond, v_cond, "v_uncond")
    if isinstance(scale, torch.Tensor):
        if tuple(scale.shape) != (v_cond.shape[0],):
            raise InvalidRequestError("a per-row guidance scale has shape (B,)", field="scale",
                                      expected=(v_cond.shape[0],), actual=tuple(scale.shape))
        scale = rows(scale.to(v_cond.dtype), v_cond.ndim)
    return v_uncond + scale * (v_cond - v_uncond)


def _x0_guidance_inputs(x: torch.Tensor, sigma: torch.Tensor, v_uncond: torch.Tensor,
                        v_cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Checked (x, sigma, v_uncond, v_cond) of an x0-space combination: float x, both
    velocities x's shape, sigma (B,) and > 0 (x0 = x at sigma = 0 carries no velocity)."""
    x = check_float_tensor(x, "x")
    v_cond = check_same_shape(v_cond, x, "v_cond")
    v_uncond = check_same_shape(v_uncond, x, "v_uncond")
    sigma = check_row_sigma(sigma, x.shape[0], "sigma")
    if not bool((sigma > 0).all()):
        raise InvalidRequestError("x0-space guidance needs sigma > 0", field="sigma",
                                  expected="> 0", actual=sigma.tolist())
    return x, sigma, v_uncond, v_cond


def cfg_x0(x: torch.Tensor, sigma: torch.Tensor, v_uncond: torch.Tensor, v_cond: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Guidance applied to the x0 estimates, returned as a velocity. x, v_*: (B, *S); sigma: (B,)
    with sigma > 0 (x0 = x at sigma = 0 carries no velocity)."""
    x, sigma, v_uncond, v_cond = _x0_guidance_inputs(x, sigma, v_uncond, v_cond)
    s = rows(sigma, x.ndim)
    x0_u = x - s * v_uncond
    x0_c = x - s * v_cond
    x0 = x0_u + scale * (x0_c - x0_u)
    return (x - x0) / s


# ---- declared guidance forms ------------------------------------------------------------------
# A family whose pipeline combines the two CFG branches otherwise than v_u + g (v_c - v_u)
# declares it once, as its denoiser's `guidance_form`; diffusion/step.py applies it (never the
# family). LTX-2: per stream (video tokens | audio tokens) in x0 space, as deltas
# x0_c + (g - 1)(x0_c - x0_u), then guidance rescale, then back to a velocity.

STREAM_BOUNDS = "guidance_stream_bounds"   # media input: (1 or B, n + 1) int64 offsets of the
                                           # streams in the flattened per-row state


class GuidanceSpace(str, Enum):
    VELOCITY = "velocity"    # v = v_u + g (v_c - v_u)
    VELOCITY_NORM = "velocity_norm"   # v_u + g (v_c - v_u), rescaled to |v_c| per token (the
                                      # state's last axis): Qwen-Image's true CFG
    X0 = "x0"                # per stream on x0 = x - sigma v, deltas, optional rescale


@dataclass(frozen=True)
class GuidanceStream:
    """One contiguous stream of a flat sampler state.

    scale: None = the row's guidance_scale; a number = this stream's own fixed scale (LTX-2's
    audio_guidance_scale). rescale: phi of guidance rescale (Lin et al. 2024, "Common Diffusion
    Noise Schedules and Sample Steps are Flawed", eq. 15-16) on the guided x0, 0 = off:
    x0 <- phi * x0_g * std(x0_c) / std(x0_g) + (1 - phi) * x0_g, std per row over the stream.
    """

    name: str
    scale: float | None = None
    rescale: float = 0.0

    def __post_init__(self) -> None:
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale >= 0):
            raise ConfigError("a stream's guidance scale is a finite number >= 0",
                              field=f"guidance.{self.name}.scale", actual=self.scale)
        if not 0.0 <= self.rescale <= 1.0:
            raise ConfigError("guidance rescale lies in [0, 1]",
                              field=f"guidance.{self.name}.rescale", expected="[0, 1]",
                              actual=self.rescale)


@dataclass(frozen=True)
class GuidanceForm:
    """How CFG combines the unconditional and conditional velocities of a family."""

    space: GuidanceSpace = GuidanceSpace.VELOCITY
    streams: tuple[GuidanceStream, ...] = (GuidanceStream("state"),)

    def __post_init__(self) -> None:
        if self.space is not GuidanceSpace.X0 and self.streams != (GuidanceStream("state"),):
            raise ConfigError("velocity-space CFG has one stream at the row's scale, no rescale",
                              field="guidance.streams", actual=[s.name for s in self.streams])

    def combine(self, x: torch.Tensor, sigma: torch.Tensor, v_uncond: torch.Tensor,
                v_cond: torch.Tensor, scale: torch.Tensor,
                bounds: torch.Tensor | None = None) -> torch.Tensor:
        """The guided velocity (B, *S) fp32. scale: (B,) the rows' guidance_scale; bounds:
        (n + 1,) stream offsets into the flattened state (needed when n > 1)."""
        if self.space is GuidanceSpace.VELOCITY:
            return cfg_velocity(v_uncond, v_cond, scale)
        if self.space is GuidanceSpace.VELOCITY_NORM:
            return cfg_velocity_norm_rescaled(v_uncond, v_cond, scale)
        return x0_stream_guidance(x, sigma, v_uncond, v_cond, scale, self.streams, bounds)


VELOCITY_CFG = GuidanceForm()
NORM_RESCALED_CFG = GuidanceForm(GuidanceSpace.VELOCITY_NORM)


def cfg_velocity_norm_rescaled(v_uncond: torch.Tensor, v_cond: torch.Tensor,
                               scale: float | torch.Tensor) -> torch.Tensor:
    """Qwen-Image's true CFG: g = v_u + scale (v_c - v_u), then g |v_c| / |g| with the norms
    over the last axis (each packed token's channels). v_*: (B, *S); scale: a number or (B,)."""
    guided = cfg_velocity(v_uncond, v_cond, scale)
    return guided * (torch.linalg.vector_norm(v_cond, dim=-1, keepdim=True) /
                     torch.linalg.vector_norm(guided, dim=-1, keepdim=True))


def x0_stream_guidance(x: torch.Tensor, sigma: torch.Tensor, v_uncond: torch.Tensor,
                       v_cond: torch.Tensor, scale: torch.Tensor,
                       streams: tuple[GuidanceStream, ...],
                       bounds: torch.Tensor | None) -> torch.Tensor:
    """Per stream: x0_* = x - sigma v_*, x0 = x0_c + (g - 1)(x0_c - x0_u), rescaled, and
    v = (x - x0) / sigma. x, v_*: (B, *S); sigma, scale: (B,), sigma > 0."""
    x, sigma, v_uncond, v_cond = _x0_guidance_inputs(x, sigma, v_uncond, v_cond)
    b, n = x.shape[0], x[0].numel()
    if bounds is None:
        if len(streams) != 1:
            raise InvalidRequestError("several guidance streams need their bounds",
                                      field=STREAM_BOUNDS, expected=len(streams) + 1,
                                      actual=None)
        bounds = torch.tensor([0, n])
    offsets = [int(o) for o in bounds.reshape(-1).tolist()]
    if len(offsets) != len(streams) + 1 or offsets[0] != 0 or offsets[-1] != n or \
            any(a >= c for a, c in zip(offsets, offsets[1:])):
        raise InvalidRequestError("stream bounds must be increasing offsets 0 .. state size",
                                  field=STREAM_BOUNDS, expected=f"{len(streams) + 1} offsets "
                                  f"from 0 to {n}", actual=offsets)
    flat_x, flat_u, flat_c = x.reshape(b, n), v_uncond.reshape(b, n), v_cond.reshape(b, n)
    s = sigma.reshape(b, 1).to(x.dtype)
    row_scale = scale.to(x.dtype).reshape(b, 1)
    out = []
    for stream, start, end in zip(streams, offsets, offsets[1:]):
        xs = flat_x[:, start:end]
        x0_c = xs - flat_c[:, start:end] * s
        x0_u = xs - flat_u[:, start:end] * s
        g = row_scale if stream.scale is None else stream.scale
        x0 = x0_c + (g - 1) * (x0_c - x0_u)
        if stream.rescale > 0:
            ratio = x0_c.std(dim=1, keepdim=True) / x0.std(dim=1, keepdim=True)
            x0 = stream.rescale * (x0 * ratio) + (1 - stream.rescale) * x0
        out.append((xs - x0) / s)
    return torch.cat(out, dim=1).reshape(x.shape)
