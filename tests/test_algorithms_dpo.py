"""Diffusion-DPO loss against the hand-written logistic form."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError
from trainer.algorithms import dpo_loss, dpo_pair_inputs, sample_pair_sigmas

P, S = 4, (2, 3, 3)


def _pairs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x0_w, x0_l, noise = (torch.randn(P, *S, generator=gen, dtype=torch.float64) for _ in range(3))
    sigma = torch.tensor([0.1, 0.4, 0.7, 0.95], dtype=torch.float64)
    return dpo_pair_inputs(x0_w, x0_l, noise, sigma), x0_w, x0_l, noise, sigma


def test_pair_inputs_share_noise_and_sigma():
    inputs, x0_w, x0_l, noise, sigma = _pairs()
    s = sigma.view(P, 1, 1, 1)
    torch.testing.assert_close(inputs.x_winner, (1 - s) * x0_w + s * noise)
    torch.testing.assert_close(inputs.x_loser, (1 - s) * x0_l + s * noise)
    torch.testing.assert_close(inputs.target_winner, noise - x0_w)
    # x_sigma - sigma u recovers x0 with the shared noise (posterior identity)
    torch.testing.assert_close(inputs.x_loser - s * inputs.target_loser, x0_l)
    with pytest.raises(InvalidRequestError, match="sigma"):
        dpo_pair_inputs(x0_w, x0_l, noise, sigma + 1)


def test_theta_equal_ref_gives_log2_and_zero_accuracy():
    inputs, *_ = _pairs(1)
    v_w = torch.randn(P, *S, dtype=torch.float64)
    v_l = torch.randn(P, *S, dtype=torch.float64)
    out = dpo_loss(v_w, v_l, v_w, v_l, inputs.target_winner, inputs.target_loser, beta=100.0)
    assert math.isclose(float(out.loss.detach()), math.log(2), rel_tol=1e-12)
    assert float(out.implicit_acc) == 0.0


def test_matches_numpy_and_swap_identity():
    inputs, *_ = _pairs(2)
    gen = torch.Generator().manual_seed(5)
    v_w, v_l, r_w, r_l = (inputs.target_winner + 0.3 * torch.randn(P, *S, generator=gen,
                                                                 dtype=torch.float64)
                          for _ in range(4))
    beta = 3.0
    out = dpo_loss(v_w, v_l, r_w, r_l, inputs.target_winner, inputs.target_loser, beta=beta)
    e = [((a - t) ** 2).reshape(P, -1).mean(1).numpy() for a, t in
         ((v_w, inputs.target_winner), (v_l, inputs.target_loser), (r_w, inputs.target_winner),
          (r_l, inputs.target_loser))]
    inside = -0.5 * beta * ((e[0] - e[1]) - (e[2] - e[3]))
    want = np.mean(np.log1p(np.exp(-inside)))          # -log sigmoid(x) = log(1 + e^-x)
    assert math.isclose(float(out.loss.detach()), want, rel_tol=1e-10)
    assert math.isclose(float(out.implicit_acc), np.mean(inside > 0))
    # with one pair, p(w > l) + p(l > w) = 1
    for i in range(P):
        a = dpo_loss(v_w[i:i + 1], v_l[i:i + 1], r_w[i:i + 1], r_l[i:i + 1],
                     inputs.target_winner[i:i + 1], inputs.target_loser[i:i + 1], beta=beta)
        b = dpo_loss(v_l[i:i + 1], v_w[i:i + 1], r_l[i:i + 1], r_w[i:i + 1],
                     inputs.target_loser[i:i + 1], inputs.target_winner[i:i + 1], beta=beta)
        total = math.exp(-float(a.loss.detach())) + math.exp(-float(b.loss.detach()))
        assert math.isclose(total, 1.0, rel_tol=1e-12)


def test_gradient_lowers_winner_error():
    inputs, *_ = _pairs(3)
    v_w = inputs.target_winner + 0.5
    v_l = inputs.target_loser + 0.5
    theta_w = v_w.clone().requires_grad_(True)
    out = dpo_loss(theta_w, v_l, v_w, v_l, inputs.target_winner, inputs.target_loser, beta=10.0)
    out.loss.backward()
    # descent moves the winner prediction toward its target: -grad . (target - v) > 0
    assert float((-theta_w.grad * (inputs.target_winner - v_w)).sum()) > 0


def test_input_errors():
    inputs, *_ = _pairs()
    v = torch.zeros(P, *S, dtype=torch.float64)
    with pytest.raises(ConfigError, match="beta"):
        dpo_loss(v, v, v, v, inputs.target_winner, inputs.target_loser, beta=0.0)
    with pytest.raises(InvalidRequestError, match="ref_v_loser"):
        dpo_loss(v, v, v, v[:2], inputs.target_winner, inputs.target_loser, beta=1.0)


def test_pair_sigmas_come_from_the_shifted_training_table():
    sigmas = sample_pair_sigmas(4000, shift=3.0, generator=torch.Generator().manual_seed(0))
    k = np.arange(1, 1001) / 1000.0
    table = 3.0 * k / (1 + 2.0 * k)                      # shifted training sigmas
    nearest = np.abs(sigmas.numpy()[:, None] - table[None, :]).min(1)
    assert nearest.max() < 1e-6                           # every draw is a table entry
    assert 0 < float(sigmas.min()) and float(sigmas.max()) <= 1.0
    # logit-normal(0, 1): median u = 1/2 -> median sigma = shift(1/2) = 0.75
    assert abs(float(sigmas.median()) - 0.75) < 0.02
    again = sample_pair_sigmas(4000, shift=3.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sigmas, again)
