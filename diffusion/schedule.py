"""Flow-matching noise schedule (sigma=1 noise, sigma=0 data), as a pure function.

Reproduces diffusers' `FlowMatchEulerDiscreteScheduler(num_train_timesteps, shift)`
`.set_timesteps(num_steps).sigmas` without scheduler state, including its behaviour of taking the
*already shifted* smallest training sigma as the end of the inference linspace and shifting again
(so the smallest non-zero sigma is shifted twice; tests/test_diffusion_schedule.py compares).
Static shift (SD3, Esser et al. 2024, eq. 23): sigma' = s*sigma / (1 + (s-1)*sigma).
"""
from __future__ import annotations

import numpy as np
import torch

from contract.errors import InvalidRequestError


def shift_sigma(sigma: np.ndarray | float, shift: float) -> np.ndarray | float:
    """Static resolution shift: s*sigma / (1 + (s-1)*sigma). shift=1 is the identity."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def flow_match_sigmas(num_steps: int, shift: float = 1.0,
                      num_train_timesteps: int = 1000) -> torch.Tensor:
    """The (num_steps + 1,) fp32 sigma table, descending from 1.0, ending with an appended 0."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise InvalidRequestError("num_steps must be a positive int", field="num_steps",
                                  expected=">= 1", actual=num_steps)
    if not shift > 0:
        raise InvalidRequestError("shift must be > 0", field="shift", expected="> 0", actual=shift)
    if num_train_timesteps < 2:
        raise InvalidRequestError("num_train_timesteps must be >= 2",
                                  field="num_train_timesteps", expected=">= 2",
                                  actual=num_train_timesteps)
    # training table: sigma_k = k / T for k = T..1, shifted once (computed in fp32 like diffusers)
    train = torch.linspace(1, num_train_timesteps, num_train_timesteps,
                           dtype=torch.float32) / num_train_timesteps
    train = shift * train / (1 + (shift - 1) * train)
    sigma_max, sigma_min = float(train[-1]), float(train[0])
    # inference table: uniform in sigma between the shifted ends, then shifted (again)
    t = num_train_timesteps
    sigmas = np.linspace(sigma_max * t, sigma_min * t, num_steps) / t  # (N,) float64
    sigmas = shift_sigma(sigmas, shift)
    out = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return torch.cat([out, torch.zeros(1, dtype=torch.float32)])      # (N+1,)
