"""GRPO-Guard: FlowGRPO's clipped surrogate with a normalised importance ratio and reweighted
gradient (regulated clipping).

Reference: Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping" (arXiv 2510.22319), as verl-omni's `GRPOGuardLoss` and Flow-Factory's
`GRPOGuardTrainer` compute it. FlowGRPO's log-ratio of two Gaussians of std s at one step is
((x' - mu_old)^2 - (x' - mu)^2) / (2 s^2), whose mean drifts below 0 and whose spread grows as s
shrinks (later steps), so the symmetric clip stops acting on one side. GRPO-Guard adds back the
drift of the mean, ||mu - mu_old||^2 / (2 s^2), and multiplies by s:

    rho = exp( s * (log p_theta - log p_old) + mean_elems((mu - mu_old)^2) / (2 s) )
    L   = mean( max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) / w ) + kl_beta * mean(KL)

with s = std_dev_t * sqrt(sigma - sigma_next) of the step (`StepOutput.std_dev_t * sqrt_dt`, the
reference's `scale`) and w = sqrt_dt^2 when `reweight` (verl-omni: equal gradient magnitude
across steps), w = 1 otherwise (Flow-Factory). Shapes: B = samples, *S = state.
"""
from __future__ import annotations

from enum import Enum

import torch

from contract import ConfigError, InvalidRequestError, NonFiniteError
from trainer.algorithms.flow_grpo import (FlowGRPOLoss, check_clip_options, clipped_loss,
                                         clipped_surrogate)


class PolicyRatio(str, Enum):
    """The importance ratio of FlowGRPO's clipped surrogate."""

    FLOW_GRPO = "flow_grpo"     # exp(log p_theta - log p_old) (flow_grpo)
    GRPO_GUARD = "grpo_guard"   # normalised by the step's std, mean drift added (GRPO-Guard)


def _per_row(x: torch.Tensor, rows: int, field: str) -> torch.Tensor:
    x = torch.as_tensor(x)
    if x.ndim == 0:
        x = x.expand(rows)
    if x.shape != (rows,):
        raise InvalidRequestError("one value per sample", field=field, expected=(rows,),
                                  actual=tuple(x.shape))
    return x


def guard_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                old_mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's normalised ratio per sample, (B,):
    exp(scale * (log_prob - old_log_prob) + mean_elems((mean - old_mean)^2) / (2 scale)).

    log_prob (graph), old_log_prob: (B,); mean (graph), old_mean: (B, *S) transition means of
    the current and old policy at the same x_j; scale: (B,) or scalar > 0, std_dev_t * sqrt_dt.
    """
    rows = log_prob.shape[0]
    if log_prob.ndim != 1 or old_log_prob.shape != log_prob.shape:
        raise InvalidRequestError("log_prob and old_log_prob are one value per sample",
                                  field="old_log_prob", expected=(rows,),
                                  actual=tuple(old_log_prob.shape))
    if mean.shape != old_mean.shape or mean.shape[0] != rows:
        raise InvalidRequestError("mean and old_mean differ in shape", field="old_mean",
                                  expected=tuple(mean.shape), actual=tuple(old_mean.shape))
    scale = _per_row(scale, rows, "scale").to(log_prob)
    if not bool((scale > 0).all()):
        raise InvalidRequestError("the ratio's scale must be > 0 (a deterministic step has no "
                                  "ratio)", field="scale", expected="> 0", actual=scale.tolist())
    drift = (mean - old_mean.detach()).flatten(1).pow(2).mean(dim=1)                    # (B,)
    return torch.exp((log_prob - old_log_prob.detach()) * scale + drift / (2.0 * scale))


def grpo_guard_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                    old_mean: torch.Tensor, advantages: torch.Tensor, std_dev_t: torch.Tensor,
                    sqrt_dt: torch.Tensor, *, clip_range: float, adv_clip_max: float,
                    reweight: bool = True, kl: torch.Tensor | None = None,
                    kl_beta: float = 0.0) -> FlowGRPOLoss:
    """GRPO-Guard's clipped surrogate of one step (module docstring), per sample rows (B,).

    std_dev_t, sqrt_dt: (B,) as `StepOutput` returns them; kl: (B,) or None.
    """
    check_clip_options(clip_range, adv_clip_max, kl_beta)
    if kl_beta > 0 and kl is None:
        raise ConfigError("kl_beta > 0 needs a KL tensor", field="kl", expected="tensor",
                          actual=None)
    rows = log_prob.shape[0]
    if advantages.shape != (rows,):
        raise InvalidRequestError("one advantage per sample", field="advantages",
                                  expected=(rows,), actual=tuple(advantages.shape))
    if not (torch.isfinite(old_log_prob).all() and torch.isfinite(old_mean).all()):
        raise NonFiniteError("the old policy's log-prob or mean holds NaN/Inf",
                             field="old_log_prob")
    sqrt_dt = _per_row(sqrt_dt, rows, "sqrt_dt").to(log_prob)
    std_dev_t = _per_row(std_dev_t, rows, "std_dev_t").to(log_prob)
    ratio = guard_ratio(log_prob, old_log_prob, mean, old_mean, std_dev_t * sqrt_dt)      # (B,)
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    per_row = clipped_surrogate(a, ratio, clip_range)
    if reweight:
        per_row = per_row / sqrt_dt ** 2
    return clipped_loss(per_row.mean(), ratio, (log_prob - old_log_prob).detach(), clip_range,
                        kl, kl_beta)
