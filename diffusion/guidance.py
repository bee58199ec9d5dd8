"""Classifier-free guidance (Ho & Salimans 2022), in velocity space and in x0 space.

Velocity CFG:  v = v_u + g (v_c - v_u).
x0 CFG:        x0 = x0_u + g (x0_c - x0_u) with x0_* = x - sigma v_*, then v = (x - x0) / sigma.
Both are the same map (x0 is affine in v at fixed x, sigma; notes section 1.4); the x0 form is
what some video models apply, and the trainer must repeat exactly the sampling formula.
"""
from __future__ import annotations

import torch

from contract.errors import InvalidRequestError
from diffusion._checks import check_float_tensor, check_row_sigma, check_same_shape, rows


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


def cfg_x0(x: torch.Tensor, sigma: torch.Tensor, v_uncond: torch.Tensor, v_cond: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Guidance applied to the x0 estimates, returned as a velocity. x, v_*: (B, *S); sigma: (B,)
    with sigma > 0 (x0 = x at sigma = 0 carries no velocity)."""
    x = check_float_tensor(x, "x")
    v_cond = check_same_shape(v_cond, x, "v_cond")
    v_uncond = check_same_shape(v_uncond, x, "v_uncond")
    sigma = check_row_sigma(sigma, x.shape[0], "sigma")
    if not bool((sigma > 0).all()):
        raise InvalidRequestError("x0-space guidance needs sigma > 0", field="sigma",
                                  expected="> 0", actual=sigma.tolist())
    s = rows(sigma, x.ndim)
    x0_u = x - s * v_uncond
    x0_c = x - s * v_cond
    x0 = x0_u + scale * (x0_c - x0_u)
    return (x - x0) / s
