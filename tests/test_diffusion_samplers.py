"""Sampler steps: log-prob against an independent density, limits, recompute, batching, errors."""
import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from contract.enums import SamplerKind
from contract.errors import InvalidRequestError
from diffusion import (cps_step, dance_sde_step, flow_match_sigmas, log_prob_of, ode_step,
                       sampler_step, sde_step)

SIGMAS = flow_match_sigmas(10, shift=3.0)


def _inputs(batch=4, shape=(3, 5, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g)
    v = torch.randn(batch, *shape, generator=g)
    noise = torch.randn(batch, *shape, generator=g)
    return x, v, noise


def _rows_at(steps):
    idx = torch.tensor(steps)
    return SIGMAS[idx], SIGMAS[idx + 1]


def _reference_sde(x, v, sigma, sigma_next, a, noise):
    """FlowGRPO SDE step written independently in float64 numpy, one row at a time."""
    means, stds = [], []
    for b in range(x.shape[0]):
        s, sn = float(sigma[b]), float(sigma_next[b])
        dt = sn - s
        std_dev_t = a * math.sqrt(s / (1 - (sn if s == 1.0 else s)))
        xb, vb = x[b].double().numpy(), v[b].double().numpy()
        score = -(xb + (1 - s) * vb) / s                       # -(x + (1-sigma) v) / sigma
        drift = vb - 0.5 * std_dev_t ** 2 * score              # reverse-SDE drift
        means.append(xb + drift * dt)
        stds.append(std_dev_t * math.sqrt(-dt))
    mean = np.stack(means)
    std = np.array(stds)
    prev = mean + std.reshape(-1, 1, 1, 1) * noise.double().numpy()
    return mean, std, prev


def test_sde_log_prob_equals_independent_gaussian_density():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])                 # each row at a different step
    out = sde_step(x, v, sigma, sigma_next, 0.7, noise)
    mean, std, prev = _reference_sde(x, v, sigma, sigma_next, 0.7, noise)
    np.testing.assert_allclose(out.mean.numpy(), mean, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out.std.numpy(), std, rtol=1e-5)
    np.testing.assert_allclose(out.prev_sample.numpy(), prev, atol=1e-5, rtol=1e-5)
    dist = Normal(torch.from_numpy(mean), torch.from_numpy(std).reshape(-1, 1, 1, 1))
    want = dist.log_prob(torch.from_numpy(prev)).flatten(1).mean(1)   # element-MEAN per row
    torch.testing.assert_close(out.log_prob.double(), want, atol=1e-4, rtol=1e-5)
    assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (4,)


def test_sde_sigma_one_guard_uses_next_sigma():
    x, v, noise = _inputs(batch=1)
    out = sde_step(x, v, SIGMAS[:1], SIGMAS[1:2], 0.7, noise)
    std_dev_t = 0.7 * math.sqrt(1.0 / (1.0 - float(SIGMAS[1])))
    assert math.isfinite(float(out.log_prob[0]))
    torch.testing.assert_close(out.std / out.sqrt_dt, torch.tensor([std_dev_t]), rtol=1e-5,
                               atol=0)


def test_dance_sde_is_sde_drift_with_constant_eta():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([1, 2, 5, 7])
    eta = 0.3
    out = dance_sde_step(x, v, sigma, sigma_next, eta, noise)
    s, sn = sigma.reshape(-1, 1, 1, 1).double(), sigma_next.reshape(-1, 1, 1, 1).double()
    ds = sn - s
    xd, vd = x.double(), v.double()
    mean = xd + ds * vd + (eta ** 2 / (2 * s)) * (xd + (1 - s) * vd) * ds   # DanceGRPO flux_step
    std = eta * torch.sqrt(s - sn)
    torch.testing.assert_close(out.mean.double(), mean, atol=1e-5, rtol=1e-5)
    want = Normal(mean, std).log_prob(out.prev_sample.double()).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob.double(), want, atol=1e-4, rtol=1e-5)


def test_cps_surrogate_and_mean():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 2, 4, 9])
    a = 0.8
    out = cps_step(x, v, sigma, sigma_next, a, noise)
    s, sn = sigma.reshape(-1, 1, 1, 1).double(), sigma_next.reshape(-1, 1, 1, 1).double()
    std = sn * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x.double() - s * v.double(), x.double() + (1 - s) * v.double()
    mean = (1 - sn) * x0_hat + torch.sqrt(sn ** 2 - std ** 2) * eps_hat
    torch.testing.assert_close(out.mean.double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.prev_sample.double(), mean + std * noise.double(), atol=1e-5,
                               rtol=1e-5)
    # the surrogate: -mean (x - mean)^2, no 1/(2 s^2), no normaliser
    want = -((out.prev_sample.double() - mean) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob.double(), want, atol=1e-5, rtol=1e-5)
    assert float(out.std[3]) == 0.0                           # last step: sigma_next = 0


@pytest.mark.parametrize("kind", [SamplerKind.SDE, SamplerKind.CPS, SamplerKind.DANCE_SDE])
def test_noise_level_zero_is_the_euler_step(kind):
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 1, 5, 9])
    euler = x + (sigma_next - sigma).reshape(-1, 1, 1, 1) * v
    out = sampler_step(kind, x, v, sigma, sigma_next, 0.0, noise)
    torch.testing.assert_close(out.prev_sample, euler, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.prev_sample, ode_step(x, v, sigma, sigma_next).prev_sample)
    assert out.log_prob is None
    assert bool((out.std == 0).all())


@pytest.mark.parametrize("kind,a", [(SamplerKind.SDE, 0.7), (SamplerKind.CPS, 0.8),
                                    (SamplerKind.DANCE_SDE, 0.3)])
def test_prev_sample_recompute_equals_sampled_log_prob(kind, a):
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])
    drawn = sampler_step(kind, x, v, sigma, sigma_next, a, noise)
    again = sampler_step(kind, x, v, sigma, sigma_next, a, None, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(again.log_prob, drawn.log_prob, atol=1e-6, rtol=0)
    torch.testing.assert_close(again.prev_sample, drawn.prev_sample, atol=0, rtol=0)
    # a different velocity (another policy) scores the same sample lower on average
    other = sampler_step(kind, x, v + 0.5, sigma, sigma_next, a, None,
                         prev_sample=drawn.prev_sample)
    assert float(other.log_prob.mean()) < float(drawn.log_prob.mean())


def test_rows_at_different_steps_equal_rows_alone():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 4, 7, 8])
    batch = sde_step(x, v, sigma, sigma_next, 0.7, noise)
    for b in range(4):
        one = sde_step(x[b:b + 1], v[b:b + 1], sigma[b:b + 1], sigma_next[b:b + 1], 0.7,
                       noise[b:b + 1])
        torch.testing.assert_close(one.prev_sample[0], batch.prev_sample[b], atol=1e-6, rtol=0)
        torch.testing.assert_close(one.log_prob[0], batch.log_prob[b], atol=1e-6, rtol=0)


def test_low_precision_inputs_are_upcast():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])
    out = sde_step(x.bfloat16(), v.bfloat16(), sigma, sigma_next, 0.7, noise.bfloat16())
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    ref = sde_step(x.bfloat16().float(), v.bfloat16().float(), sigma, sigma_next, 0.7,
                   noise.bfloat16().float())
    torch.testing.assert_close(out.log_prob, ref.log_prob, atol=0, rtol=0)


def test_log_prob_of_matches_normal():
    g = torch.Generator().manual_seed(5)
    mean, prev = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    std = torch.tensor([0.1, 0.5, 2.0])
    want = Normal(mean, std[:, None]).log_prob(prev).mean(1)
    torch.testing.assert_close(log_prob_of(prev, mean, std), want, atol=1e-5, rtol=1e-6)
    with pytest.raises(InvalidRequestError) as e:
        log_prob_of(prev, mean, torch.tensor([0.1, 0.0, 1.0]))
    assert e.value.field == "std"


@pytest.mark.parametrize("change,field", [
    (lambda a: a.update(sigma=a["sigma"][:2]), "sigma"),
    (lambda a: a.update(sigma_next=a["sigma"].clone()), "sigma_next"),
    (lambda a: a.update(sigma=a["sigma"] + 1.0), "sigma"),
    (lambda a: a.update(v=a["v"][:, :2]), "v"),
    (lambda a: a.update(noise=a["noise"][..., :2]), "noise"),
    (lambda a: a.update(noise=None), "noise"),
    (lambda a: a.update(prev_sample=a["x"]), "prev_sample"),          # both noise and sample
    (lambda a: a.update(noise_level=-0.1), "noise_level"),
    (lambda a: a.update(noise_level=float("nan")), "noise_level"),
    (lambda a: a.update(x=a["x"].long(), v=a["v"].long()), "x"),
    (lambda a: a.update(kind="euler"), "sampler"),
])
def test_bad_inputs_name_the_field(change, field):
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])
    args = dict(kind=SamplerKind.SDE, x=x, v=v, sigma=sigma, sigma_next=sigma_next,
                noise_level=0.7, noise=noise)
    change(args)
    with pytest.raises(InvalidRequestError) as e:
        sampler_step(**args)
    assert e.value.field == field


def test_deterministic_steps_refuse_a_log_prob_request():
    x, v, _ = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])
    with pytest.raises(InvalidRequestError) as e:
        sampler_step(SamplerKind.ODE, x, v, sigma, sigma_next, 0.7, None, prev_sample=x)
    assert e.value.field == "prev_sample"
    with pytest.raises(InvalidRequestError) as e:
        sde_step(x, v, sigma, sigma_next, 0.0, prev_sample=x)
    assert e.value.field == "prev_sample"


def test_dispatch_accepts_enum_values():
    x, v, noise = _inputs()
    sigma, sigma_next = _rows_at([0, 3, 6, 8])
    a = sampler_step("sde", x, v, sigma, sigma_next, 0.7, noise)
    b = sde_step(x, v, sigma, sigma_next, 0.7, noise)
    torch.testing.assert_close(a.prev_sample, b.prev_sample, atol=0, rtol=0)
