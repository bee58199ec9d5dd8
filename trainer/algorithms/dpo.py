"""Diffusion-DPO for flow matching (preference pairs from online rollouts).

Reference: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization"
(arXiv 2311.12908), Eq. 14, with the velocity target of flow matching as in Flow-DPO (Liu et al.,
arXiv 2501.13918). Winner and loser of a pair share the noise eps and the noise level sigma:
x_sigma = (1 - sigma) x0 + sigma eps, target u = eps - x0.
Shapes: P = pairs, *S = per-sample state shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from contract import ConfigError, InvalidRequestError
from diffusion.schedule import shift_sigma


@dataclass(frozen=True)
class DPOPairInputs:
    """Noised inputs and velocity targets of P pairs (winner w, loser l), shared eps and sigma."""

    x_winner: torch.Tensor       # (P, *S)
    x_loser: torch.Tensor        # (P, *S)
    target_winner: torch.Tensor  # (P, *S) eps - x0_w
    target_loser: torch.Tensor   # (P, *S) eps - x0_l


def dpo_pair_inputs(x0_winner: torch.Tensor, x0_loser: torch.Tensor, noise: torch.Tensor,
                    sigma: torch.Tensor) -> DPOPairInputs:
    """Noise both members of each pair with the same eps and sigma. sigma: (P,) in [0, 1]."""
    for name, t in (("x0_loser", x0_loser), ("noise", noise)):
        if t.shape != x0_winner.shape:
            raise InvalidRequestError(f"{name} must match x0_winner's shape", field=name,
                                      expected=tuple(x0_winner.shape), actual=tuple(t.shape))
    if sigma.shape != x0_winner.shape[:1] or ((sigma < 0) | (sigma > 1)).any():
        raise InvalidRequestError("sigma must be (P,) in [0, 1]", field="sigma",
                                  expected=(x0_winner.shape[0],), actual=sigma.tolist())
    s = sigma.to(x0_winner.dtype).reshape(sigma.shape + (1,) * (x0_winner.ndim - 1))
    return DPOPairInputs((1 - s) * x0_winner + s * noise, (1 - s) * x0_loser + s * noise,
                         noise - x0_winner, noise - x0_loser)


def sample_pair_sigmas(num_pairs: int, *, shift: float, generator: torch.Generator,
                       num_train_timesteps: int = 1000, logit_mean: float = 0.0,
                       logit_std: float = 1.0) -> torch.Tensor:
    """One noise level per pair: logit-normal u indexes the (shifted) TRAINING sigma table.

    u = sigmoid(N(logit_mean, logit_std^2)); index = floor(u T) into the descending T-step table
    sigma_k = shift(k / T), k = T..1 (SD3's logit-normal timestep density, Esser et al. 2024,
    arXiv 2403.03206, Sec. 3.1). Never the rollout's few-step inference table. Returns (P,) fp32.
    """
    if num_pairs < 1 or num_train_timesteps < 2:
        raise ConfigError("num_pairs >= 1 and num_train_timesteps >= 2", field="num_pairs",
                          actual=(num_pairs, num_train_timesteps))
    if logit_std <= 0 or shift <= 0:
        raise ConfigError("logit_std and shift must be > 0", field="logit_std",
                          actual=(logit_std, shift))
    u = torch.sigmoid(logit_mean + logit_std * torch.randn(num_pairs, generator=generator,
                                                           dtype=torch.float64))     # (P,)
    index = (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)    # (P,)
    k = (num_train_timesteps - index).double()                                     # T..1
    return torch.as_tensor(shift_sigma(k / num_train_timesteps, shift)).float()


def _elem_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # (P, *S) -> (P,)
    return ((pred - target) ** 2).flatten(1).mean(dim=1)


@dataclass(frozen=True)
class DPOLoss:
    """loss carries the graph; the rest are detached for logging."""

    loss: torch.Tensor           # () -mean(logsigmoid(inside))
    implicit_acc: torch.Tensor   # () mean(inside > 0)
    inside: torch.Tensor         # (P,) the logit of the preference
    model_diff: torch.Tensor     # () mean(e_w - e_l) of the policy
    ref_diff: torch.Tensor       # () mean(e_ref_w - e_ref_l)

    def metrics(self) -> dict[str, float]:
        return {"loss": float(self.loss.detach()), "implicit_acc": float(self.implicit_acc),
                "model_diff": float(self.model_diff), "ref_diff": float(self.ref_diff)}


def dpo_loss(v_winner: torch.Tensor, v_loser: torch.Tensor, ref_v_winner: torch.Tensor,
             ref_v_loser: torch.Tensor, target_winner: torch.Tensor, target_loser: torch.Tensor,
             *, beta: float) -> DPOLoss:
    """inside = -beta/2 [(e_w - e_l) - (e_ref_w - e_ref_l)],  L = -mean(logsigmoid(inside)).

    Diffusion-DPO Eq. 14; e = mean_elems((v - u)^2) (element means, so beta is resolution free).
    At theta = ref, inside = 0, L = log 2 and implicit_acc = 0 (strict '>').

    Args:
        v_winner, v_loser: (P, *S) policy velocities (with graph).
        ref_v_winner, ref_v_loser: (P, *S) reference velocities (detached here).
        target_winner, target_loser: (P, *S) flow targets u = eps - x0.
        beta: DPO inverse temperature (> 0).
    """
    if beta <= 0:
        raise ConfigError("beta must be > 0", field="beta", actual=beta)
    shape = v_winner.shape
    for name, t in (("v_loser", v_loser), ("ref_v_winner", ref_v_winner),
                    ("ref_v_loser", ref_v_loser), ("target_winner", target_winner),
                    ("target_loser", target_loser)):
        if t.shape != shape:
            raise InvalidRequestError(f"{name} must match v_winner's shape", field=name,
                                      expected=tuple(shape), actual=tuple(t.shape))
    e_w, e_l = _elem_mse(v_winner, target_winner), _elem_mse(v_loser, target_loser)   # (P,)
    with torch.no_grad():
        e_ref_w = _elem_mse(ref_v_winner, target_winner)
        e_ref_l = _elem_mse(ref_v_loser, target_loser)
    model_diff, ref_diff = e_w - e_l, e_ref_w - e_ref_l                                 # (P,)
    inside = -0.5 * beta * (model_diff - ref_diff)
    loss = -F.logsigmoid(inside).mean()
    return DPOLoss(loss, (inside.detach() > 0).float().mean(), inside.detach(),
                   model_diff.detach().mean(), ref_diff.mean())
