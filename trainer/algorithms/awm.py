"""AWM, advantage-weighted matching: the pretraining flow-matching loss as the policy's
log-likelihood inside FlowGRPO's clipped surrogate.

Reference: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models" (arXiv 2509.25050), as Flow-Factory's AWMTrainer computes it. A sample x0 is noised by
the forward process at sigma, x_sigma = (1 - sigma) x0 + sigma eps, and scored by its weighted
matching error against the target velocity eps - x0 (the project's v convention):

    log p_theta = w(sigma, -mean_elems((v_theta(x_sigma) - (eps - x0))^2))
    L = mean( max(-A rho, -A clip(rho, 1 - eps_c, 1 + eps_c)) ),  rho = exp(log p - log p_old)

log p_old: the same draw (sigma, eps) under the old policy, without gradient. The matching error
is computed in float64, as the reference does. Shapes: B = samples, *S = state.
"""
from __future__ import annotations

from enum import Enum

import torch

from contract import ConfigError, InvalidRequestError
from trainer.algorithms.flow_grpo import FlowGRPOLoss, flow_grpo_loss


class AWMWeighting(str, Enum):
    """How the matching error becomes a log-likelihood, with m = mean_elems((v - target)^2)."""

    UNIFORM = "uniform"        # -m
    SIGMA = "sigma"            # -m sigma
    SIGMA_SQUARED = "sigma2"   # -m sigma^2
    HUBER = "huber"            # -(sqrt(m + 1e-10) - 1e-5) sigma
    GHUBER = "ghuber"          # -((m + 1e-10)^p - 1e-10^p) sigma / p


def awm_log_prob(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                 sigma: torch.Tensor, weighting: AWMWeighting = AWMWeighting.UNIFORM,
                 ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's log-likelihood of x0 under `velocity` at the draw (sigma, noise), per sample.

    velocity (graph), x0, noise: (B, *S); sigma: (B,) in [0, 1]. Returns (B,) float32.
    """
    weighting = AWMWeighting(weighting)
    if velocity.shape != x0.shape or noise.shape != x0.shape:
        raise InvalidRequestError("velocity, x0 and noise differ in shape", field="velocity",
                                  expected=tuple(x0.shape), actual=tuple(velocity.shape))
    if sigma.shape != (x0.shape[0],):
        raise InvalidRequestError("one sigma per sample", field="sigma",
                                  expected=(x0.shape[0],), actual=tuple(sigma.shape))
    if not bool(((sigma >= 0) & (sigma <= 1)).all()):
        raise InvalidRequestError("sigma must lie in [0, 1]", field="sigma", expected="[0, 1]",
                                  actual=sigma.tolist())
    if weighting is AWMWeighting.GHUBER and not ghuber_power > 0:
        raise ConfigError("ghuber_power must be > 0", field="ghuber_power", actual=ghuber_power)
    target = (noise - x0).double()
    m = (velocity.double() - target).pow(2).flatten(1).mean(dim=1)                      # (B,)
    s = sigma.double()
    if weighting is AWMWeighting.UNIFORM:
        out = -m
    elif weighting is AWMWeighting.SIGMA:
        out = -m * s
    elif weighting is AWMWeighting.SIGMA_SQUARED:
        out = -m * s ** 2
    elif weighting is AWMWeighting.HUBER:
        out = -(torch.sqrt(m + 1e-10) - 1e-5) * s
    else:
        eps = torch.tensor(1e-10, dtype=m.dtype, device=m.device)
        out = -(torch.pow(m + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * s / ghuber_power
    return out.float()


def awm_loss(velocity: torch.Tensor, old_log_prob: torch.Tensor, x0: torch.Tensor,
             noise: torch.Tensor, sigma: torch.Tensor, advantages: torch.Tensor, *,
             clip_range: float, adv_clip_max: float,
             weighting: AWMWeighting = AWMWeighting.UNIFORM, ghuber_power: float = 0.25,
             kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> FlowGRPOLoss:
    """AWM's clipped surrogate of one draw (module docstring); old_log_prob: (B,) from
    `awm_log_prob` of the old policy's velocity at the same draw; kl: (B,) or None."""
    log_prob = awm_log_prob(velocity, x0, noise, sigma, weighting, ghuber_power)
    return flow_grpo_loss(log_prob, old_log_prob, advantages, clip_range=clip_range,
                          adv_clip_max=adv_clip_max, kl=kl, kl_beta=kl_beta)
