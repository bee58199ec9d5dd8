"""One sampler step from sigma to sigma_next, with the transition's log-probability.

Conventions (diffusion/conventions.py): sigma=1 noise, sigma=0 data, v = eps - x0,
dt = sigma_next - sigma < 0. Every row may sit at a different step: `sigma` and `sigma_next` are
(B,) and broadcast over the sample axes. All math is fp32 (bf16 overflows in the log-density).

Kinds:
  SDE        FlowGRPO Euler-Maruyama discretisation of the marginal-preserving reverse SDE
             (Liu et al. 2025, arXiv 2505.05470, eq. 9), std_dev_t = a * sqrt(sigma / (1 - sigma)).
  ODE        deterministic Euler, x + dt * v.
  CPS        coefficients-preserving sampling (arXiv 2509.05952); its "log-prob" is the surrogate
             -mean((x_next - mean)^2), not a density.
  DANCE_SDE  DanceGRPO: the same drift with a constant std_dev_t = eta.

log-probs are the element-MEAN over the non-batch axes (not the sum), which keeps importance
ratios near 1. With `prev_sample` given, the step scores that sample instead of drawing one (the
trainer recomputes log-probs on a stored trajectory this way).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from contract.enums import SamplerKind
from contract.errors import InvalidRequestError
from contract.request import MIN_NOISE_LEVEL
from diffusion._checks import (check_float_tensor, check_per_row, check_row_sigma,
                               check_same_shape, rows)

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class StepOutput:
    """prev_sample, mean: (B, *S) fp32; log_prob: (B,) fp32 or None for a deterministic step;
    std: (B,) transition std (0 for a deterministic step); sqrt_dt: (B,) sqrt(sigma - sigma_next);
    std_dev_t: (B,) the kind's noise scale as the FlowGRPO reference defines it, the divisor of
    the KL on the transition mean: std / sqrt_dt for the SDE kinds (the diffusion coefficient of
    the SDE), the transition std itself for CPS (sigma_next sin(a pi/2), already a per-step std),
    0 for a deterministic step."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor
    sqrt_dt: torch.Tensor
    std_dev_t: torch.Tensor
    history: "SolverHistory | None" = None   # multistep solvers: what the next step needs


def log_prob_of(prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Element-mean log N(prev_sample; mean, std^2 I) per row. prev/mean: (B, *S); std: (B,) > 0.

    log p = mean_over_S[ -(x - mean)^2 / (2 std^2) - log std - log sqrt(2 pi) ]   -> (B,)
    """
    prev_sample = check_float_tensor(prev_sample, "prev_sample").float()
    mean = check_same_shape(mean, prev_sample, "mean").float()
    std = check_per_row(std, prev_sample.shape[0], "std").float()
    if not bool((std > 0).all()):
        raise InvalidRequestError("log-density needs std > 0 (a deterministic step has none)",
                                  field="std", expected="> 0", actual=std.tolist())
    return _gaussian_elem(prev_sample, mean, std).flatten(1).mean(dim=1)


def _gaussian_elem(prev_sample: torch.Tensor, mean: torch.Tensor,
                   std: torch.Tensor) -> torch.Tensor:
    """Per-entry log N(x; mean, std^2): (B, *S). std: (B,) > 0."""
    s = rows(std, prev_sample.ndim)
    return -((prev_sample - mean) ** 2) / (2 * s ** 2) - torch.log(s) - _LOG_SQRT_2PI


def _surrogate_elem(prev_sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per-entry CPS surrogate -(x - mean)^2: no 1/(2 std^2), no normaliser (arXiv 2509.05952)."""
    return -((prev_sample - mean) ** 2)


def _surrogate_log_prob(prev_sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """CPS surrogate: -mean_over_S (x - mean)^2 per row."""
    return _surrogate_elem(prev_sample, mean).flatten(1).mean(dim=1)


def _prepare(x, v, sigma, sigma_next, noise_level, noise, prev_sample):
    """Validate and upcast the inputs of a step. Returns fp32 (x, v, sigma, sigma_next, noise,
    prev_sample) with noise / prev_sample None where not given."""
    x = check_float_tensor(x, "x")
    if x.ndim < 1:
        raise InvalidRequestError("x needs a leading batch axis", field="x", expected="(B, ...)",
                                  actual=tuple(x.shape))
    v = check_same_shape(v, x, "v")
    batch = x.shape[0]
    sigma = check_row_sigma(sigma, batch, "sigma")
    sigma_next = check_row_sigma(sigma_next, batch, "sigma_next")
    if not bool((sigma_next < sigma).all()):
        raise InvalidRequestError("each row must step down in noise (sigma_next < sigma)",
                                  field="sigma_next", expected=f"< {sigma.tolist()}",
                                  actual=sigma_next.tolist())
    if isinstance(noise_level, bool) or not isinstance(noise_level, (int, float)) \
            or not math.isfinite(noise_level) or noise_level < 0:
        raise InvalidRequestError("noise_level must be a finite number >= 0", field="noise_level",
                                  expected=">= 0", actual=noise_level)
    if noise is not None and prev_sample is not None:
        raise InvalidRequestError("give either noise (to draw a sample) or prev_sample (to score "
                                  "one), not both", field="prev_sample", expected="None",
                                  actual="a tensor")
    if noise is not None:
        noise = check_same_shape(noise, x, "noise").float()
    if prev_sample is not None:
        prev_sample = check_same_shape(prev_sample, x, "prev_sample").float()
    return x.float(), v.float(), sigma.float(), sigma_next.float(), noise, prev_sample


def _finish(mean: torch.Tensor, std: torch.Tensor, sqrt_dt: torch.Tensor,
            std_dev_t: torch.Tensor, noise_level: float, noise: torch.Tensor | None,
            prev_sample: torch.Tensor | None,
            score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
            ) -> StepOutput:
    """Draw (or take) the next sample of N(mean, std^2 I) and score it."""
    if noise_level == 0:
        # deterministic: the step is the Euler step and has no density
        if prev_sample is not None:
            raise InvalidRequestError("a log-prob is undefined at noise_level 0", field="prev_sample",
                                      expected="None", actual="a tensor")
        zero = torch.zeros_like(std)
        return StepOutput(mean, None, mean, zero, sqrt_dt, zero)
    if prev_sample is None:
        if noise is None:
            raise InvalidRequestError("a stochastic step needs noise (or prev_sample to score)",
                                      field="noise", expected="tensor (B, *S)", actual=None)
        prev_sample = mean + rows(std, mean.ndim) * noise
    return StepOutput(prev_sample, score(prev_sample, mean, std), mean, std, sqrt_dt, std_dev_t)


def _gaussian(prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return log_prob_of(prev_sample, mean, std)


def _surrogate(prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return _surrogate_log_prob(prev_sample, mean)


def _sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor,
              std_dev_t: torch.Tensor) -> torch.Tensor:
    """Euler-Maruyama mean of dx = [v + std_dev_t^2/(2 sigma) (x + (1-sigma) v)] dt.
    x, v: (B, *S); sigma, dt, std_dev_t: (B,)."""
    s, d, g = (rows(t, x.ndim) for t in (sigma, dt, std_dev_t))
    return x * (1 + g ** 2 * d / (2 * s)) + v * (1 + g ** 2 * (1 - s) / (2 * s)) * d


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             noise_level: float, noise: torch.Tensor | None = None,
             prev_sample: torch.Tensor | None = None) -> StepOutput:
    """FlowGRPO SDE step (arXiv 2505.05470, eq. 9). noise_level is `a` in std_dev_t = a sqrt(sigma/(1-sigma)).

    At sigma == 1 (exact float equality) the denominator uses sigma_next instead of sigma, the
    reference code's guard against 1/0.
    """
    x, v, sigma, sigma_next, noise, prev_sample = _prepare(x, v, sigma, sigma_next, noise_level,
                                                           noise, prev_sample)
    dt = sigma_next - sigma                                                   # (B,) < 0
    denom = 1 - torch.where(sigma == 1, sigma_next, sigma)                    # (B,)
    std_dev_t = noise_level * torch.sqrt(sigma / denom)                       # (B,)
    sqrt_dt = torch.sqrt(-dt)
    mean = _sde_mean(x, v, sigma, dt, std_dev_t)
    return _finish(mean, std_dev_t * sqrt_dt, sqrt_dt, std_dev_t, noise_level, noise,
                   prev_sample, _gaussian)


def dance_sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
                   sigma_next: torch.Tensor, noise_level: float,
                   noise: torch.Tensor | None = None,
                   prev_sample: torch.Tensor | None = None) -> StepOutput:
    """DanceGRPO step: the SDE drift with a constant std_dev_t = eta (= noise_level) and
    transition std eta * sqrt(sigma - sigma_next) (DanceGRPO's reference code)."""
    x, v, sigma, sigma_next, noise, prev_sample = _prepare(x, v, sigma, sigma_next, noise_level,
                                                           noise, prev_sample)
    dt = sigma_next - sigma
    std_dev_t = torch.full_like(sigma, float(noise_level))
    sqrt_dt = torch.sqrt(-dt)
    mean = _sde_mean(x, v, sigma, dt, std_dev_t)
    return _finish(mean, std_dev_t * sqrt_dt, sqrt_dt, std_dev_t, noise_level, noise,
                   prev_sample, _gaussian)


def cps_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             noise_level: float, noise: torch.Tensor | None = None,
             prev_sample: torch.Tensor | None = None) -> StepOutput:
    """Coefficients-preserving step (arXiv 2509.05952): re-noise the x0 estimate to sigma_next
    with a share std = sigma_next sin(a pi/2) of fresh noise.

    mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat,
    x0_hat = x - sigma v, eps_hat = x + (1 - sigma) v. log_prob is the CPS surrogate.
    """
    x, v, sigma, sigma_next, noise, prev_sample = _prepare(x, v, sigma, sigma_next, noise_level,
                                                           noise, prev_sample)
    std = sigma_next * math.sin(noise_level * math.pi / 2)                    # (B,)
    s, sn, st = (rows(t, x.ndim) for t in (sigma, sigma_next, std))
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v
    mean = (1 - sn) * x0_hat + torch.sqrt((sn ** 2 - st ** 2).clamp_min(0)) * eps_hat
    sqrt_dt = torch.sqrt(sigma - sigma_next)
    return _finish(mean, std, sqrt_dt, std, noise_level, noise, prev_sample, _surrogate)


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             noise_level: float = 0.0, noise: torch.Tensor | None = None,
             prev_sample: torch.Tensor | None = None) -> StepOutput:
    """Euler step x + (sigma_next - sigma) v. noise_level and noise are ignored (the signature
    matches the other kinds); an ODE step has no density, so prev_sample is refused."""
    if prev_sample is not None:
        raise InvalidRequestError("an ODE step has no log-prob to recompute", field="prev_sample",
                                  expected="None", actual="a tensor")
    x, v, sigma, sigma_next, _, _ = _prepare(x, v, sigma, sigma_next, 0.0, None, None)
    dt = sigma_next - sigma
    mean = x + rows(dt, x.ndim) * v
    zero = torch.zeros_like(sigma)
    return StepOutput(mean, None, mean, zero, torch.sqrt(-dt), zero)


@dataclass(frozen=True)
class SolverHistory:
    """A multistep solver's memory of the previous step, per row: its data prediction
    x0_hat = x - sigma v (B, *S) and its sigma (B,)."""

    x0: torch.Tensor
    sigma: torch.Tensor

    @classmethod
    def initial(cls, x: torch.Tensor) -> "SolverHistory":
        """The start of a schedule that does not begin at sigma = 1: a 'previous step' at
        sigma = 1 has lambda = -inf and contributes no correction (a first-order step)."""
        return cls(torch.zeros_like(x), torch.ones(x.shape[0], dtype=torch.float32,
                                                    device=x.device))


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha / sigma) of the flow path alpha = 1 - sigma (float64, -inf at 1)."""
    return torch.log1p(-sigma) - torch.log(sigma)


def dpm2_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
              noise_level: float = 0.0, noise: torch.Tensor | None = None,
              prev_sample: torch.Tensor | None = None,
              history: SolverHistory | None = None) -> StepOutput:
    """Deterministic multistep DPM-Solver++(2M) (Lu et al. 2022, arXiv 2211.01095, Alg. 2) in
    the flow parameterisation alpha = 1 - sigma with data prediction x0_hat = x - sigma v: the
    DiffusionNFT reference's rollout solver ("dpm2").

    With h = lambda_next - lambda, r = (lambda - lambda_prev) / h, D = x0_hat + (x0_hat -
    x0_prev) / (2 r):
        x_next = (sigma_next / sigma) x - alpha_next (e^-h - 1) D
    First order (D = x0_hat, i.e. the DDIM / Euler step) where there is no previous step, where
    the previous step started at sigma = 1 (lambda = -inf: its correction vanishes) and on the
    final step into sigma = 0 (lower-order final, as the reference and diffusers do).
    history: the previous step's `StepOutput.history`; None only at sigma = 1, the schedule's
    first step (elsewhere a missing history would silently drop to first order: refused; a
    schedule starting below 1 passes `SolverHistory.initial(x)`).
    No log-prob (deterministic); noise_level and noise are ignored.
    """
    if prev_sample is not None:
        raise InvalidRequestError("a DPM-Solver step has no log-prob to recompute",
                                  field="prev_sample", expected="None", actual="a tensor")
    x, v, sigma, sigma_next, _, _ = _prepare(x, v, sigma, sigma_next, 0.0, None, None)
    if history is None and not bool((sigma == 1).all()):
        raise InvalidRequestError("dpm2 needs the previous step's history after the first "
                                  "step", field="history", expected="SolverHistory",
                                  actual=None)
    x0_hat = x - rows(sigma, x.ndim) * v
    s, sn = sigma.double(), sigma_next.double()
    ratio = rows((sn / s).float(), x.ndim)                                 # sigma_next / sigma
    alpha_next = 1 - sn
    first = ratio * x + rows((alpha_next - sn * (1 - s) / s).float(), x.ndim) * x0_hat
    if history is None:
        x_next = first
    else:
        sp = check_row_sigma(history.sigma, x.shape[0], "history.sigma").double()
        prev_x0 = check_same_shape(history.x0, x, "history.x0").float()
        second_order = (sp < 1) & (sn > 0)                                   # (B,)
        safe_sp = torch.where(second_order, sp, torch.full_like(sp, 0.5))
        safe_sn = torch.where(second_order, sn, torch.full_like(sn, 0.5))
        h = _log_snr(safe_sn) - _log_snr(s)
        r = (_log_snr(s) - _log_snr(safe_sp)) / h
        coef = -(1 - safe_sn) * torch.expm1(-h)                              # -alpha (e^-h - 1)
        d = x0_hat + rows((0.5 / r).float(), x.ndim) * (x0_hat - prev_x0)
        second = rows((safe_sn / s).float(), x.ndim) * x + rows(coef.float(), x.ndim) * d
        x_next = torch.where(rows(second_order, x.ndim), second, first)
    zero = torch.zeros_like(sigma)
    return StepOutput(x_next, None, x_next, zero, torch.sqrt(sigma - sigma_next), zero,
                      SolverHistory(x0_hat, sigma))


_STEPS: dict[SamplerKind, Callable[..., StepOutput]] = {
    SamplerKind.SDE: sde_step,
    SamplerKind.ODE: ode_step,
    SamplerKind.CPS: cps_step,
    SamplerKind.DANCE_SDE: dance_sde_step,
    SamplerKind.DPM2: dpm2_step,
}


def sampler_step(kind: SamplerKind | str, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
                 sigma_next: torch.Tensor, noise_level: float, noise: torch.Tensor | None,
                 prev_sample: torch.Tensor | None = None,
                 history: SolverHistory | None = None) -> StepOutput:
    """Dispatch one step by sampler kind. x, v, noise, prev_sample: (B, *S); sigma(_next): (B,).
    history: the previous step's `StepOutput.history` for a multistep kind (DPM2)."""
    try:
        kind = SamplerKind(kind)
    except ValueError:
        raise InvalidRequestError("unknown sampler kind", field="sampler",
                                  expected=[k.value for k in SamplerKind], actual=kind) from None
    if kind in MULTISTEP:
        return _STEPS[kind](x, v, sigma, sigma_next, noise_level, noise=noise,
                            prev_sample=prev_sample, history=history)
    if history is not None:
        raise InvalidRequestError(f"{kind.value} is a one-step sampler: it takes no history",
                                  field="history", expected=None, actual="SolverHistory")
    return _STEPS[kind](x, v, sigma, sigma_next, noise_level, noise=noise,
                        prev_sample=prev_sample)


def check_noise_representable(kind: SamplerKind, sigmas: torch.Tensor,
                              window: tuple[int, int], noise_level: float,
                              field: str = "sampling.noise_level",
                              request_id: str | None = None) -> None:
    """Refuse, before any work, a noise level whose stochastic steps float32 cannot carry on
    this schedule: the transition std of every window step (computed by the step itself) must
    be > 0 and, for the Gaussian kinds, its square must be a normal float32 so the log-density
    1/(2 std^2) and log std are finite. CPS steps into sigma 0 have no noise by construction
    and are not counted. sigmas: (N+1,) the request's table; window: [start, end)."""
    kind = SamplerKind(kind)
    start, end = window
    if kind in DETERMINISTIC or end <= start:
        return
    sigma = sigmas[start:end].float().cpu()
    sigma_next = sigmas[start + 1:end + 1].float().cpu()
    zeros = torch.zeros(sigma.shape[0], 1)
    try:
        std = sampler_step(kind, zeros, zeros, sigma, sigma_next, noise_level, zeros).std
    except InvalidRequestError as exc:   # the step's own density check: its std is 0
        if exc.field != "std":
            raise
        std = torch.zeros_like(sigma)
    if kind is SamplerKind.CPS:
        bad = (std <= 0) & (sigma_next > 0)
    else:
        bad = ~((std > 0) & torch.isfinite(1.0 / (std * std)) &
                (std * std >= torch.finfo(torch.float32).tiny))
    if bool(bad.any()):
        step = start + int(bad.nonzero()[0])
        raise InvalidRequestError(f"noise_level is too small for float32: the {kind.value} "
                                  f"step {step} would have a transition std of "
                                  f"{float(std[step - start]):.3g}", field=field,
                                  expected=f">= {MIN_NOISE_LEVEL.get(kind, 0.0)}",
                                  actual=noise_level, request_id=request_id)


MULTISTEP = frozenset({SamplerKind.DPM2})          # kinds that carry a SolverHistory
DETERMINISTIC = frozenset({SamplerKind.ODE, SamplerKind.DPM2})   # no noise, no log-prob


def log_density(kind: SamplerKind | str, prev_sample: torch.Tensor, mean: torch.Tensor,
                std: torch.Tensor, free: torch.Tensor | None = None) -> torch.Tensor:
    """The log-prob a step of `kind` assigns to prev_sample (B,), averaged over the `free`
    entries only (B, *S) bool (None = all): frozen condition entries are not sampled, so they
    are not scored. Gaussian kinds use log_prob_of's element density, CPS its surrogate."""
    kind = SamplerKind(kind)
    prev_sample, mean = prev_sample.float(), mean.float()
    if kind is SamplerKind.CPS:
        elem = _surrogate_elem(prev_sample, mean)
    elif kind in (SamplerKind.SDE, SamplerKind.DANCE_SDE):
        elem = _gaussian_elem(prev_sample, mean,
                              check_per_row(std, prev_sample.shape[0], "std").float())
    else:
        raise InvalidRequestError("this sampler kind has no log-prob", field="sampler",
                                  expected=["sde", "dance_sde", "cps"], actual=kind.value)
    if free is None:
        return elem.flatten(1).mean(dim=1)
    free = free.to(elem.device).flatten(1)
    count = free.sum(dim=1)
    if bool((count == 0).any()):
        raise InvalidRequestError("every entry of a row is frozen: nothing is sampled",
                                  field="frozen.mask", expected="some free entries", actual=0)
    return (elem.flatten(1) * free).sum(dim=1) / count
