"""THE one place where a model's time convention is converted to the project's.

Inside the project sigma=1 is noise, sigma=0 is data, x_sigma = (1-sigma) x0 + sigma eps, and the
velocity is v = eps - x0 (it points toward noise). Models read time in one of two conventions:

    NOISE_LEVEL:   model time t = scale * sigma,       the model predicts  v        (SD3, Wan, FLUX)
    DATA_PROGRESS: model time t = scale * (1 - sigma), the model predicts -v = x0 - eps
                   (time runs toward data, so its velocity points toward data)

Flipping both time and sign leaves every sampler step unchanged (tests/test_diffusion_conventions.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from contract.enums import TimeConvention
from contract.errors import InvalidRequestError

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _convention(convention: TimeConvention | str) -> TimeConvention:
    try:
        return TimeConvention(convention)
    except ValueError:
        raise InvalidRequestError("unknown time convention", field="convention",
                                  expected=[c.value for c in TimeConvention],
                                  actual=convention) from None


_MODEL_TIME: dict[TimeConvention, Callable[[torch.Tensor], torch.Tensor]] = {
    TimeConvention.NOISE_LEVEL: lambda sigma: sigma,
    TimeConvention.DATA_PROGRESS: lambda sigma: 1.0 - sigma,
}

_VELOCITY_SIGN: dict[TimeConvention, float] = {
    TimeConvention.NOISE_LEVEL: 1.0,
    TimeConvention.DATA_PROGRESS: -1.0,
}


def model_time(sigma: torch.Tensor, convention: TimeConvention | str,
               scale: float = 1.0) -> torch.Tensor:
    """The time value a model of `convention` expects at noise level `sigma` (any shape)."""
    return scale * _MODEL_TIME[_convention(convention)](sigma)


def to_sigma_velocity(raw: torch.Tensor, convention: TimeConvention | str) -> torch.Tensor:
    """A model's raw output -> velocity eps - x0 in the sigma convention."""
    sign = _VELOCITY_SIGN[_convention(convention)]
    return raw if sign > 0 else -raw


def from_sigma_velocity(v: torch.Tensor, convention: TimeConvention | str) -> torch.Tensor:
    """Inverse of `to_sigma_velocity`: a sigma-convention velocity -> the model's raw output."""
    sign = _VELOCITY_SIGN[_convention(convention)]
    return v if sign > 0 else -v


def predict_velocity(model_fn: ModelFn, x: torch.Tensor, sigma: torch.Tensor,
                     convention: TimeConvention | str, scale: float = 1.0) -> torch.Tensor:
    """Call `model_fn(x, model_time)` and return its prediction as v = eps - x0.

    x: (B, *S); sigma: (B,) per-row noise level; model_fn receives the (B,) model time.
    """
    if tuple(sigma.shape) != (x.shape[0],):
        raise InvalidRequestError("sigma must have one value per row", field="sigma",
                                  expected=(x.shape[0],), actual=tuple(sigma.shape))
    raw = model_fn(x, model_time(sigma, convention, scale))
    if raw.shape != x.shape:
        raise InvalidRequestError("model output shape differs from the sample",
                                  field="model_output", expected=tuple(x.shape),
                                  actual=tuple(raw.shape))
    return to_sigma_velocity(raw, convention)
