"""Marginal preservation with the exact velocity of 1-D Gaussian data.

x0 ~ N(1.5, 0.5^2). With the exact v(x, sigma) = E[eps - x0 | x_sigma], the Euler ODE and the
FlowGRPO SDE carry N(0, 1) at sigma = 1 to the data law as the step count grows. CPS is not
marginal-preserving at finite steps, so it gets no such test.
"""
import pytest
import torch

from contract.enums import SamplerKind
from diffusion import flow_match_sigmas, initial_noise, sampler_step
from tests.test_diffusion_conventions import MU, SD, gaussian_velocity

N_SAMPLES = 10000


def _start():
    """N(0, 1) draws standardised to sample mean 0 / std 1, so only the sampler moves moments."""
    x = initial_noise([0], (N_SAMPLES,))[0].reshape(N_SAMPLES, 1)      # rows = samples
    return (x - x.mean()) / x.std()


def _run(kind, num_steps, noise_level, shift=1.0, return_samples=False):
    sigmas = flow_match_sigmas(num_steps, shift=shift)
    x = _start()
    g = torch.Generator().manual_seed(1)
    for i in range(num_steps):
        s = sigmas[i].expand(N_SAMPLES)
        sn = sigmas[i + 1].expand(N_SAMPLES)
        noise = torch.randn(N_SAMPLES, 1, generator=g)
        x = sampler_step(kind, x, gaussian_velocity(x, s), s, sn, noise_level, noise).prev_sample
    if return_samples:
        return x
    return float(x.mean()), float(x.std())


def test_ode_reaches_the_data_marginal():
    mean, std = _run(SamplerKind.ODE, 100, 0.0)
    assert abs(mean - MU) < 0.01 and abs(std - SD) < 0.01
    # for Gaussian data the exact flow is the affine map x1 -> MU + SD x1; Euler converges to it
    exact = MU + SD * _start()
    err = [float((_run(SamplerKind.ODE, n, 0.0, return_samples=True) - exact).abs().max())
           for n in (10, 100)]
    assert err[1] < err[0] / 5 and err[1] < 0.05          # first order: ~10x smaller


def test_sde_reaches_the_data_marginal_as_steps_grow():
    coarse = _run(SamplerKind.SDE, 10, 0.7, shift=3.0)     # SD3's shift
    fine = _run(SamplerKind.SDE, 100, 0.7)
    assert abs(fine[0] - MU) < 0.02 and abs(fine[1] - SD) < 0.02
    # discretisation error shrinks with the step count (std 0.418 at 10 steps)
    assert abs(coarse[1] - SD) > abs(fine[1] - SD)
    assert coarse[1] == pytest.approx(0.418, abs=0.02)


def test_dance_sde_reaches_the_data_marginal():
    mean, std = _run(SamplerKind.DANCE_SDE, 100, 0.3)
    assert abs(mean - MU) < 0.02 and abs(std - SD) < 0.02
