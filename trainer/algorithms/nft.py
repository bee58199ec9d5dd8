"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process.

Reference: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
(arXiv 2509.16117): implicit positive/negative policies, the negative-aware flow-matching loss,
adaptive (self-normalised) weighting and the soft old-policy update. Rollouts come from the "old"
policy; the trainer noises the clean samples x0 afresh: x_sigma = (1 - sigma) x0 + sigma eps,
target v = eps - x0.
Shapes: B = samples, *S = per-sample state shape, D = prod(S).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

import torch

from contract import ConfigError, InvalidRequestError


def _elem_mean(x: torch.Tensor) -> torch.Tensor:  # (B, *S) -> (B,)
    return x.flatten(1).mean(dim=1)


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Scalar or (B,) -> (B, 1, ...) broadcastable against `like` (B, *S)."""
    v = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if v.ndim == 0:
        v = v.expand(like.shape[0])
    if v.shape != like.shape[:1]:
        raise InvalidRequestError("per-sample value must be a scalar or (B,)", field="sigma",
                                  expected=(like.shape[0],), actual=tuple(v.shape))
    return v.reshape(v.shape + (1,) * (like.ndim - 1))


@dataclass(frozen=True)
class NFTLoss:
    """loss carries the graph; the rest are detached scalars for logging."""

    loss: torch.Tensor            # () policy_loss + ref_kl_coef * ref_kl
    policy_loss: torch.Tensor     # () adv_clip_max * mean(r L+ / beta + (1 - r) L- / beta)
    positive_loss: torch.Tensor   # () mean L+
    negative_loss: torch.Tensor   # () mean L-
    ref_kl: torch.Tensor          # () mean_elems((v_theta - v_ref)^2), 0 without a reference

    def metrics(self) -> dict[str, float]:
        return {name: float(getattr(self, name).detach()) for name in
                ("loss", "policy_loss", "positive_loss", "negative_loss", "ref_kl")}


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_sigma: torch.Tensor, x0: torch.Tensor,
             sigma: torch.Tensor | float, optimality: torch.Tensor, *, beta: float,
             adv_clip_max: float, v_ref: torch.Tensor | None = None, ref_kl_coef: float = 0.0,
             weight_min: float = 1e-5) -> NFTLoss:
    """DiffusionNFT loss with x0-space adaptive weighting.

        v+ = beta v_theta + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v_theta
        x0+- = x_sigma - sigma v+-,  w+- = stopgrad(mean_elems|x0+- - x0|) clipped >= weight_min
        L+- = mean_elems((x0+- - x0)^2) / w+-
        L  = c * mean_B(r L+ / beta + (1 - r) L- / beta) + ref_kl_coef * mean((v_theta - v_ref)^2)

    Since x0+- - x0 = -sigma (v+- - v), this is the paper's r||v+ - v||^2 + (1-r)||v- - v||^2
    with a self-normalising weight; at v_theta = v_old the gradient is
    2(2r-1) sigma^2 (v_old - v) c / (w D B), independent of beta. `beta` is the guidance
    strength, not the KL coefficient `ref_kl_coef`.

    Args:
        v_theta: (B, *S) velocity of the trained ("default") adapter, with graph.
        v_old: (B, *S) velocity of the old (sampling) adapter; detached here.
        x_sigma: (B, *S) the noised input the velocities were computed at.
        x0: (B, *S) clean rollout sample.
        sigma: scalar or (B,) noise level of x_sigma.
        optimality: (B,) r in [0, 1] (advantages.optimality_probability).
        v_ref: (B, *S) reference (adapters disabled) velocity, needed when ref_kl_coef > 0.
    """
    if not 0 < beta:
        raise ConfigError("beta (NFT guidance strength) must be > 0", field="beta", actual=beta)
    if adv_clip_max <= 0:
        raise ConfigError("adv_clip_max must be > 0", field="adv_clip_max", actual=adv_clip_max)
    if ref_kl_coef < 0:
        raise ConfigError("ref_kl_coef must be >= 0", field="ref_kl_coef", actual=ref_kl_coef)
    if weight_min <= 0:
        raise ConfigError("weight_min must be > 0", field="weight_min", actual=weight_min)
    if ref_kl_coef > 0 and v_ref is None:
        raise ConfigError("ref_kl_coef > 0 needs v_ref", field="v_ref", expected="tensor",
                          actual=None)
    for name, t in (("v_old", v_old), ("x_sigma", x_sigma), ("x0", x0)):
        if t.shape != v_theta.shape:
            raise InvalidRequestError(f"{name} must match v_theta's shape", field=name,
                                      expected=tuple(v_theta.shape), actual=tuple(t.shape))
    if optimality.shape != v_theta.shape[:1]:
        raise InvalidRequestError("one optimality probability per sample", field="optimality",
                                  expected=(v_theta.shape[0],), actual=tuple(optimality.shape))
    if ((optimality < 0) | (optimality > 1)).any():
        raise InvalidRequestError("optimality must lie in [0, 1]", field="optimality",
                                  actual=optimality.tolist())
    v_old = v_old.detach()
    s = _per_sample(sigma, v_theta)                                           # (B, 1...)
    v_plus = beta * v_theta + (1.0 - beta) * v_old                            # implicit policies
    v_minus = (1.0 + beta) * v_old - beta * v_theta
    x0_plus = x_sigma - s * v_plus                                            # (B, *S)
    x0_minus = x_sigma - s * v_minus
    with torch.no_grad():  # adaptive weights: float64, stop-grad
        w_plus = _elem_mean((x0_plus.double() - x0.double()).abs()).clamp(min=weight_min)
        w_minus = _elem_mean((x0_minus.double() - x0.double()).abs()).clamp(min=weight_min)
    loss_plus = _elem_mean((x0_plus - x0) ** 2) / w_plus.to(v_theta.dtype)    # (B,)
    loss_minus = _elem_mean((x0_minus - x0) ** 2) / w_minus.to(v_theta.dtype)
    r = optimality.to(v_theta.dtype)
    policy_loss = adv_clip_max * (r * loss_plus / beta + (1.0 - r) * loss_minus / beta).mean()
    ref_kl = torch.zeros((), dtype=v_theta.dtype, device=v_theta.device)
    if v_ref is not None:
        if v_ref.shape != v_theta.shape:
            raise InvalidRequestError("v_ref must match v_theta's shape", field="v_ref",
                                      expected=tuple(v_theta.shape), actual=tuple(v_ref.shape))
        ref_kl = _elem_mean((v_theta - v_ref.detach()) ** 2).mean()
    loss = policy_loss + ref_kl_coef * ref_kl
    return NFTLoss(loss, policy_loss.detach(), loss_plus.mean().detach(),
                   loss_minus.mean().detach(), ref_kl.detach())


class TimestepOrder(str, Enum):
    """Which schedule steps a sample is trained at, over the train_timesteps draws of one update."""

    UNIFORM = "uniform"            # i.i.d. uniform over the rollout's steps (repeats possible)
    PERMUTATION = "permutation"    # the first draws of a per-sample permutation: no repeats
                                   # (the DiffusionNFT reference, timestep_fraction of the steps)


def nft_timestep_indices(rows: int, num_steps: int, draws: int, order: TimestepOrder,
                         generator: torch.Generator) -> torch.Tensor:
    """(draws, rows) int64 indices into the rollout's num_steps noise levels: row b is trained
    at sigmas[idx[k, b]] in draw k. PERMUTATION needs draws <= num_steps."""
    order = TimestepOrder(order)
    if rows < 1 or num_steps < 1 or draws < 1:
        raise ConfigError("rows, num_steps and draws must be >= 1", field="draws",
                          actual=(rows, num_steps, draws))
    if order is TimestepOrder.UNIFORM:
        return torch.randint(num_steps, (draws, rows), generator=generator)
    if draws > num_steps:
        raise ConfigError("a permutation visits each of the rollout's steps once",
                          field="train_timesteps", expected=f"<= {num_steps}", actual=draws)
    keys = torch.rand(rows, num_steps, generator=generator)                    # (rows, N)
    return keys.argsort(dim=1)[:, :draws].T.contiguous()                       # (draws, rows)


class OldPolicySchedule(str, Enum):
    """Decay d of the soft old-policy update theta_old <- d theta_old + (1 - d) theta."""

    COPY = "copy"                                        # d = 0
    LINEAR_TO_0_5 = "linear_to_0_5"                      # d = min(0.001 step, 0.5)
    DELAYED_LINEAR_TO_0_999 = "delayed_linear_to_0_999"  # d = 0 before step 75, then
                                                         #   min(0.0075 (step - 75), 0.999)


def old_decay(step: int, schedule: OldPolicySchedule) -> float:
    """Decay of the soft old-policy update at optimizer step `step` (>= 0)."""
    if step < 0:
        raise ConfigError("step must be >= 0", field="step", actual=step)
    schedule = OldPolicySchedule(schedule)
    if schedule is OldPolicySchedule.COPY:
        return 0.0
    if schedule is OldPolicySchedule.LINEAR_TO_0_5:
        return min(0.001 * step, 0.5)
    if step < 75:
        return 0.0
    return min(0.0075 * (step - 75), 0.999)


@torch.no_grad()
def ema_update(old_params: Iterable[torch.Tensor], new_params: Iterable[torch.Tensor],
               decay: float) -> None:
    """In place: old <- decay * old + (1 - decay) * new; decay = 0 copies (DiffusionNFT)."""
    if not 0.0 <= decay <= 1.0:
        raise ConfigError("decay must lie in [0, 1]", field="decay", expected="[0, 1]",
                          actual=decay)
    old_list, new_list = list(old_params), list(new_params)
    if len(old_list) != len(new_list):
        raise InvalidRequestError("old and new parameter lists differ in length",
                                  field="new_params", expected=len(old_list),
                                  actual=len(new_list))
    for i, (old, new) in enumerate(zip(old_list, new_list)):
        if old.shape != new.shape:
            raise InvalidRequestError(f"parameter {i} differs in shape", field="new_params",
                                      expected=tuple(old.shape), actual=tuple(new.shape))
        if decay == 0.0:
            old.copy_(new)
        else:
            old.mul_(decay).add_(new.to(old.dtype), alpha=1.0 - decay)
