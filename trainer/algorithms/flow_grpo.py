"""FlowGRPO: PPO-style clipped surrogate on the SDE transition log-probs of a stored trajectory.

Reference: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470),
the clipped GRPO objective with a KL to the reference, on the SDE obtained from the flow ODE.
The log-prob of step j is recomputed by the trainer with `diffusion.samplers.sampler_step(...,
prev_sample=x_{j+1})` on the stored fp32 (x_j, x_{j+1}); `old_log_prob` is the rollout's value
where the learner's old policy sampled the row, else recomputed (`OldLogProbs`).
Shapes: B = samples, K = trained steps, *S = per-sample state shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from contract import (ConfigError, InvalidRequestError, NonFiniteError, PolicyVersionError,
                      Trajectory)
from diffusion.samplers import StepOutput
from diffusion.step import FrozenLatents, transition


class OldLogProbs(str, Enum):
    """Where the ratio's old-policy log-probs come from. The old policy is the learner's policy
    before this update (PPO's pi_old): the last version it published.

    ROLLOUT: a row sampled by that version keeps the log-probs the rollout stored (recorded in
    fp32 by the same step function; the per-step parity check bounds |ratio - 1| between the
    two), so its old log-probs cost nothing; a row of another version (an async batch sampled
    before the last update) is recomputed. RECOMPUTE: every row's old log-prob is recomputed by
    the learner, one extra no-grad forward per trained step (verl's default). FlowGRPO only:
    DiffusionNFT and Diffusion-DPO use no log-probs."""

    ROLLOUT = "rollout"
    RECOMPUTE = "recompute"


def reusable_rows(mode: OldLogProbs, versions: tuple[str, ...] | list[str],
                  old_version: str) -> torch.Tensor:
    """(B,) bool: rows whose stored rollout log-probs stand in for the old policy's."""
    if mode is OldLogProbs.RECOMPUTE:
        return torch.zeros(len(versions), dtype=torch.bool)
    return torch.tensor([v == old_version for v in versions], dtype=torch.bool)


def rollout_old_log_probs(log_probs: torch.Tensor, versions: tuple[str, ...] | list[str],
                          old_version: str) -> torch.Tensor:
    """The stored rollout log-probs as old-policy log-probs, only for rows that policy sampled:
    a row of another version is a PolicyVersionError naming both (never a silent reuse)."""
    for i, version in enumerate(versions):
        if version != old_version:
            raise PolicyVersionError("rollout log-probs stand in for the old policy's only on "
                                     "rows that policy sampled", field=f"versions[{i}]",
                                     expected=old_version, actual=version)
    return log_probs


class KLTarget(str, Enum):
    """Where the KL to the reference policy is measured."""

    SDE_MEAN = "sde_mean"    # mean_elems((mu_theta - mu_ref)^2) / (2 std_dev_t^2)  (default)
    VELOCITY = "velocity"    # mean_elems((v_theta - v_ref)^2)  (train without CFG, test with CFG)


def trainable_step_indices(sigmas: torch.Tensor, window: tuple[int, int],
                           max_steps: int | None = None) -> list[int]:
    """Steps j in window [start, end) whose transition is trainable: sigma_{j+1} > 0.

    The step into sigma = 0 (the last one) is never trained: its Gaussian is extremely sharp and
    the log-prob overflows (the FlowGRPO recipe trains 99% of steps for this reason).
    `max_steps` keeps the first ones.

    Args:
        sigmas: (N+1,) schedule, sigmas[0] = 1 ... sigmas[N] = 0.
        window: (start, end) stochastic steps of the rollout, 0 <= start <= end <= N.
    Raises:
        InvalidRequestError: window outside the schedule. ConfigError: nothing left to train.
    """
    num_steps = int(sigmas.shape[0]) - 1
    start, end = window
    if not 0 <= start <= end <= num_steps:
        raise InvalidRequestError("window outside the schedule", field="window",
                                  expected=f"0 <= start <= end <= {num_steps}", actual=window)
    if max_steps is not None and max_steps < 1:
        raise ConfigError("max_steps must be >= 1", field="max_steps", actual=max_steps)
    steps = [j for j in range(start, end) if float(sigmas[j + 1]) > 0.0]
    if max_steps is not None:
        steps = steps[:max_steps]
    if not steps:
        raise ConfigError("the window has no trainable step (only steps into sigma = 0)",
                          field="window", expected="a step with sigma_next > 0", actual=window)
    return steps


@dataclass(frozen=True)
class WindowStep:
    """One stored transition x_j -> x_{j+1} of a trajectory (all fp32)."""

    step: int                    # absolute step index j
    x: torch.Tensor              # (B, *S) state before the step
    x_next: torch.Tensor         # (B, *S) state after the step
    sigma: float                 # sigma_j
    sigma_next: float            # sigma_{j+1}
    old_log_prob: torch.Tensor   # (B,) rollout-time element-mean log-prob


def window_step(trajectory: Trajectory, step: int) -> WindowStep:
    """The stored transition of absolute step `step` (latents hold window steps only)."""
    start, end = trajectory.window
    if not start <= step < end:
        raise InvalidRequestError("step outside the trajectory window", field="step",
                                  expected=f"[{start}, {end})", actual=step)
    k = step - start
    return WindowStep(step, trajectory.latents[:, k], trajectory.latents[:, k + 1],
                      float(trajectory.sigmas[step]), float(trajectory.sigmas[step + 1]),
                      trajectory.log_probs[:, k])


def recompute_step(trajectory: Trajectory, step: int, velocity: torch.Tensor) -> StepOutput:
    """Score the stored x_{j+1} under `velocity` at x_j: log p_theta(x_{j+1} | x_j).

    Same sampler kind and noise level as the rollout; velocity: (B, *S) in the project convention
    (v = eps - x0), with graph. `transition_kl` compares two of these.
    """
    s = window_step(trajectory, step)
    rows = s.x.shape[0]
    sigma = torch.full((rows,), s.sigma, dtype=torch.float32, device=s.x.device)
    sigma_next = torch.full((rows,), s.sigma_next, dtype=torch.float32, device=s.x.device)
    frozen = None
    if trajectory.frozen_mask is not None:      # condition entries: held, not scored
        mask = trajectory.frozen_mask.to(s.x.device)
        frozen = FrozenLatents(mask, s.x_next)
    return transition(trajectory.sampler, s.x, velocity, sigma, sigma_next,
                      trajectory.noise_level, None, prev_sample=s.x_next, frozen=frozen)


def _elem_mean(x: torch.Tensor) -> torch.Tensor:  # (B, *S) -> (B,)
    return x.flatten(1).mean(dim=1)


def sde_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor,
                std_dev_t: torch.Tensor | float) -> torch.Tensor:
    """KL_j = mean_elems((mu_theta - mu_ref)^2) / (2 std_dev_t^2), per sample.

    FlowGRPO's KL on the SDE mean, without the sqrt(-dt) factor of the exact Gaussian KL (so later
    steps weigh more). mean, ref_mean: (B, *S); std_dev_t: scalar or (B,) > 0.
    Returns (B,).
    """
    std = torch.as_tensor(std_dev_t, dtype=mean.dtype, device=mean.device)
    if (std <= 0).any():
        raise InvalidRequestError("std_dev_t must be > 0 (an ODE step has no KL on the SDE mean)",
                                  field="std_dev_t", expected="> 0", actual=std.tolist())
    if mean.shape != ref_mean.shape:
        raise InvalidRequestError("mean and ref_mean differ in shape", field="ref_mean",
                                  expected=tuple(mean.shape), actual=tuple(ref_mean.shape))
    return _elem_mean((mean - ref_mean) ** 2) / (2.0 * std ** 2)


def transition_kl(step: StepOutput, ref_step: StepOutput) -> torch.Tensor:
    """FlowGRPO's KL of one transition to the reference's, per sample: (B,).

    KL_j = mean_elems((mu_theta - mu_ref)^2) / (2 std_dev_t^2), std_dev_t the sampler kind's own
    noise scale (`StepOutput.std_dev_t`, as the reference's step function returns it):
      SDE / DANCE_SDE: the diffusion coefficient, transition std / sqrt(sigma - sigma_next); the
        result is the exact Gaussian KL times (sigma - sigma_next) (the reference dropped dt from
        the denominator in Jul-2025 so later steps weigh more);
      CPS: the transition std sigma_next sin(a pi/2) itself; the result is the exact Gaussian KL
        of N(mu_theta, s^2 I) to N(mu_ref, s^2 I). Dividing it by sqrt(dt) as for the SDE kinds
        would shrink the KL by the factor (sigma - sigma_next).
    Both steps must come from the same kind at the same (x_j, sigma_j, sigma_{j+1}).
    """
    if not torch.equal(step.std_dev_t, ref_step.std_dev_t):
        raise InvalidRequestError("policy and reference transitions have different noise scales",
                                  field="ref_step.std_dev_t", expected=step.std_dev_t.tolist(),
                                  actual=ref_step.std_dev_t.tolist())
    return sde_mean_kl(step.mean, ref_step.mean, step.std_dev_t)


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """KL proxy on the velocity: mean_elems((v_theta - v_ref)^2), per sample. (B, *S) -> (B,)."""
    if velocity.shape != ref_velocity.shape:
        raise InvalidRequestError("velocity and ref_velocity differ in shape", field="ref_velocity",
                                  expected=tuple(velocity.shape), actual=tuple(ref_velocity.shape))
    return _elem_mean((velocity - ref_velocity) ** 2)


@dataclass(frozen=True)
class FlowGRPOLoss:
    """loss carries the graph; the rest are detached scalars for logging."""

    loss: torch.Tensor          # () policy_loss + kl_beta * kl
    policy_loss: torch.Tensor   # () clipped surrogate
    kl: torch.Tensor            # () mean KL term (0 when no KL is given)
    clipfrac: torch.Tensor      # () fraction with |ratio - 1| > clip_range
    approx_kl: torch.Tensor     # () 0.5 * mean((log_prob - old_log_prob)^2)
    ratio_mean: torch.Tensor    # () mean importance ratio

    def metrics(self) -> dict[str, float]:
        return {name: float(getattr(self, name).detach()) for name in
                ("loss", "policy_loss", "kl", "clipfrac", "approx_kl", "ratio_mean")}


def check_clip_options(clip_range: float, adv_clip_max: float, kl_beta: float) -> None:
    """The clipped objective's options (FlowGRPO and GRPO-Guard alike)."""
    if clip_range <= 0:
        raise ConfigError("clip_range must be > 0", field="clip_range", actual=clip_range)
    if adv_clip_max <= 0:
        raise ConfigError("adv_clip_max must be > 0", field="adv_clip_max", actual=adv_clip_max)
    if kl_beta < 0:
        raise ConfigError("kl_beta must be >= 0", field="kl_beta", actual=kl_beta)


def flow_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   *, clip_range: float, adv_clip_max: float, kl: torch.Tensor | None = None,
                   kl_beta: float = 0.0) -> FlowGRPOLoss:
    """L = mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) ) + kl_beta * mean(KL).

    FlowGRPO's clipped objective: rho = exp(log p_theta(x_{j+1}|x_j) - log p_old(x_{j+1}|x_j)),
    A clipped to +-adv_clip_max and shared by every step of a sample.

    Args:
        log_prob: (B,) or (B, K) recomputed element-mean log-probs (carry the graph).
        old_log_prob: same shape, rollout-time log-probs (no graph).
        advantages: (B,) group advantages.
        kl: per-sample KL, same shape as log_prob (from sde_mean_kl / velocity_kl), or None.
    """
    check_clip_options(clip_range, adv_clip_max, kl_beta)
    if log_prob.shape != old_log_prob.shape:
        raise InvalidRequestError("log_prob and old_log_prob differ in shape", field="old_log_prob",
                                  expected=tuple(log_prob.shape), actual=tuple(old_log_prob.shape))
    if advantages.ndim != 1 or advantages.shape[0] != log_prob.shape[0]:
        raise InvalidRequestError("one advantage per sample", field="advantages",
                                  expected=(log_prob.shape[0],), actual=tuple(advantages.shape))
    if kl_beta > 0 and kl is None:
        raise ConfigError("kl_beta > 0 needs a KL tensor", field="kl", expected="tensor",
                          actual=None)
    if not torch.isfinite(old_log_prob).all():
        raise NonFiniteError("old_log_prob holds NaN/Inf", field="old_log_prob")
    a = advantages.clamp(-adv_clip_max, adv_clip_max)                         # (B,)
    a = a.reshape(a.shape + (1,) * (log_prob.ndim - 1))                      # (B, 1...) broadcast
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)                                              # rho
    policy_loss = clipped_surrogate(a, ratio, clip_range).mean()
    return clipped_loss(policy_loss, ratio, log_ratio, clip_range, kl, kl_beta)


def clipped_surrogate(advantages: torch.Tensor, ratio: torch.Tensor,
                      clip_range: float) -> torch.Tensor:
    """max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) per element: the pessimistic bound of the
    clipped objective (FlowGRPO and GRPO-Guard alike); advantages broadcast against ratio."""
    return torch.maximum(-advantages * ratio,
                         -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))


def clipped_loss(policy_loss: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor,
                 clip_range: float, kl: torch.Tensor | None, kl_beta: float) -> FlowGRPOLoss:
    """policy_loss + kl_beta * mean(KL) (kl: one value per log-prob, the shape of log_ratio, or
    None) and the clipped objective's diagnostics (FlowGRPO and GRPO-Guard alike)."""
    kl_term = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl is not None:
        if kl.shape != log_ratio.shape:
            raise InvalidRequestError("kl must match log_prob's shape", field="kl",
                                      expected=tuple(log_ratio.shape), actual=tuple(kl.shape))
        kl_term = kl.mean()
    loss = policy_loss + kl_beta * kl_term
    with torch.no_grad():
        clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
        approx_kl = 0.5 * (log_ratio ** 2).mean()
        ratio_mean = ratio.mean()
    return FlowGRPOLoss(loss, policy_loss.detach(), kl_term.detach(), clipfrac, approx_kl,
                        ratio_mean)
