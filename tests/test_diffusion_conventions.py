"""Time conventions (sigma vs data progress) and CFG forms."""
import pytest
import torch

from contract.enums import SamplerKind, TimeConvention
from contract.errors import InvalidRequestError
from diffusion import (cfg_velocity, cfg_x0, flow_match_sigmas, from_sigma_velocity, model_time,
                       initial_noise, predict_velocity, row_noise, sampler_step, to_sigma_velocity)

MU, SD = 1.5, 0.5   # 1-D Gaussian data x0 ~ N(MU, SD^2)


def gaussian_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Exact v = E[eps - x0 | x_sigma] for Gaussian data; x: (B, *S), sigma: (B,)."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    var = (1 - s) ** 2 * SD ** 2 + s ** 2
    centred = x - (1 - s) * MU
    return s / var * centred - (MU + (1 - s) * SD ** 2 / var * centred)


def noise_level_model(x, t):        # reads sigma * 1000, predicts v
    return gaussian_velocity(x, t / 1000)


def data_progress_model(x, tau):    # reads tau = 1 - sigma in [0, 1], predicts velocity to data
    return -gaussian_velocity(x, 1 - tau)


def _sample(model, convention, scale, sigmas, kind, seeds=(3, 4, 5, 6)):
    x = initial_noise(seeds, (2, 3))
    for i in range(len(sigmas) - 1):
        s = sigmas[i].expand(len(seeds))
        sn = sigmas[i + 1].expand(len(seeds))
        v = predict_velocity(model, x, s, convention, scale)
        x = sampler_step(kind, x, v, s, sn, 0.7, row_noise(seeds, i, (2, 3))).prev_sample
    return x


def test_model_time_values():
    sigma = torch.tensor([1.0, 0.25, 0.0])
    torch.testing.assert_close(model_time(sigma, TimeConvention.NOISE_LEVEL, 1000.0),
                               torch.tensor([1000.0, 250.0, 0.0]))
    torch.testing.assert_close(model_time(sigma, TimeConvention.DATA_PROGRESS, 1.0),
                               torch.tensor([0.0, 0.75, 1.0]))


def test_velocity_conversion_round_trips():
    raw = torch.randn(2, 4)
    for c in TimeConvention:
        torch.testing.assert_close(from_sigma_velocity(to_sigma_velocity(raw, c), c), raw)
    torch.testing.assert_close(to_sigma_velocity(raw, TimeConvention.DATA_PROGRESS), -raw)
    torch.testing.assert_close(to_sigma_velocity(raw, "noise_level"), raw)


@pytest.mark.parametrize("kind", [SamplerKind.ODE, SamplerKind.SDE])
def test_convention_flip_gives_identical_samples_dyadic(kind):
    # dyadic sigmas: 1 - (1 - sigma) is exact, so the two loops must agree bit for bit
    sigmas = torch.arange(8, -1, -1, dtype=torch.float32) / 8
    a = _sample(noise_level_model, TimeConvention.NOISE_LEVEL, 1000.0, sigmas, kind)
    b = _sample(data_progress_model, TimeConvention.DATA_PROGRESS, 1.0, sigmas, kind)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [SamplerKind.ODE, SamplerKind.SDE, SamplerKind.CPS])
def test_convention_flip_full_loop_shifted_schedule(kind):
    sigmas = flow_match_sigmas(12, shift=3.0)
    a = _sample(noise_level_model, TimeConvention.NOISE_LEVEL, 1000.0, sigmas, kind)
    b = _sample(data_progress_model, TimeConvention.DATA_PROGRESS, 1.0, sigmas, kind)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # reading the wrong convention is not silently equivalent
    c = _sample(data_progress_model, TimeConvention.NOISE_LEVEL, 1.0, sigmas, kind)
    assert not torch.allclose(a, c, atol=1e-2)


def test_predict_velocity_errors():
    x = torch.randn(2, 3)
    with pytest.raises(InvalidRequestError) as e:
        predict_velocity(noise_level_model, x, torch.ones(3), TimeConvention.NOISE_LEVEL)
    assert e.value.field == "sigma"
    with pytest.raises(InvalidRequestError) as e:
        predict_velocity(lambda x, t: x[:, :1], x, torch.ones(2), TimeConvention.NOISE_LEVEL)
    assert e.value.field == "model_output"
    with pytest.raises(InvalidRequestError) as e:
        model_time(torch.ones(2), "reversed")
    assert e.value.field == "convention"


@pytest.mark.parametrize("scale", [1.0, 4.5, 0.0, 7.0])
def test_cfg_x0_equals_cfg_velocity(scale):
    g = torch.Generator().manual_seed(1)
    x, vu, vc = (torch.randn(4, 3, 6, generator=g) for _ in range(3))
    sigma = torch.tensor([1.0, 0.7, 0.3, 0.01])
    torch.testing.assert_close(cfg_x0(x, sigma, vu, vc, scale), cfg_velocity(vu, vc, scale),
                               atol=2e-4, rtol=1e-4)


def test_cfg_scale_one_is_the_conditional_branch():
    g = torch.Generator().manual_seed(2)
    vu, vc = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    torch.testing.assert_close(cfg_velocity(vu, vc, 1.0), vc)
    torch.testing.assert_close(cfg_velocity(vu, vc, 0.0), vu)


def test_cfg_errors():
    x = torch.randn(2, 5)
    with pytest.raises(InvalidRequestError) as e:
        cfg_x0(x, torch.tensor([0.5, 0.0]), x, x, 2.0)
    assert e.value.field == "sigma"
    with pytest.raises(InvalidRequestError) as e:
        cfg_velocity(x[:, :2], x, 2.0)
    assert e.value.field == "v_uncond"
