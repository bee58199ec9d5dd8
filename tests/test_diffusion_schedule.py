"""flow_match_sigmas equals the real diffusers scheduler's sigma table."""
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from contract.errors import InvalidRequestError
from diffusion import flow_match_sigmas, shift_sigma


@pytest.mark.parametrize("num_steps", [1, 2, 3, 10, 28, 40, 100])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 0.5])
def test_matches_diffusers(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(num_steps)
    ours = flow_match_sigmas(num_steps, shift=shift)
    assert ours.dtype == torch.float32
    assert ours.shape == (num_steps + 1,)
    torch.testing.assert_close(ours, scheduler.sigmas, atol=1e-6, rtol=0)
    # the model timesteps diffusers feeds SD3 are sigma * 1000
    torch.testing.assert_close(ours[:-1] * 1000, scheduler.timesteps, atol=1e-3, rtol=0)


def test_sd3_table_at_ten_steps():
    want = torch.tensor([1.000, 0.960, 0.913, 0.858, 0.790, 0.707, 0.602, 0.465, 0.278, 0.0089, 0])
    torch.testing.assert_close(flow_match_sigmas(10, shift=3.0), want, atol=6e-4, rtol=0)


def test_descending_from_one_to_zero():
    s = flow_match_sigmas(25, shift=3.0)
    assert s[0] == 1.0 and s[-1] == 0.0
    assert bool((s[1:] < s[:-1]).all())


def test_shift_identity_and_monotone():
    x = torch.linspace(0, 1, 11, dtype=torch.float64)
    torch.testing.assert_close(shift_sigma(x, 1.0), x)
    shifted = shift_sigma(x, 3.0)
    assert bool((shifted[1:-1] > x[1:-1]).all())          # shift > 1 spends more steps at high noise


@pytest.mark.parametrize("kwargs,field", [({"num_steps": 0}, "num_steps"),
                                          ({"num_steps": 2.5}, "num_steps"),
                                          ({"num_steps": 10, "shift": 0.0}, "shift")])
def test_bad_arguments(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        flow_match_sigmas(**kwargs)
    assert e.value.field == field
