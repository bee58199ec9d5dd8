"""DiffusionNFT loss, gradient at init, old-policy schedule and EMA against hand derivations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError
from trainer.algorithms import OldPolicySchedule, ema_update, nft_loss, old_decay

B, C, H, W = 3, 2, 4, 4
D = C * H * W


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
    eps = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
    sigma = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    s = sigma.view(B, 1, 1, 1)
    x_sigma = (1 - s) * x0 + s * eps
    v_old = eps - x0 + 0.3 * torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
    return x0, eps, sigma, x_sigma, v_old


def _numpy_nft(v_theta, v_old, x_sigma, x0, sigma, r, beta, c):
    # independent transcription of DiffusionNFT Eq. 6 / 10 with adaptive x0-space weights
    s = sigma.reshape(-1, 1, 1, 1)
    vp = beta * v_theta + (1 - beta) * v_old
    vm = (1 + beta) * v_old - beta * v_theta
    per = []
    for v_hat, weight in ((vp, r), (vm, 1 - r)):
        err = (x_sigma - s * v_hat) - x0
        w = np.maximum(np.abs(err).reshape(len(r), -1).mean(1), 1e-5)
        per.append(weight * (err ** 2).reshape(len(r), -1).mean(1) / w / beta)
    return c * np.mean(per[0] + per[1])


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_matches_numpy(beta):
    x0, _, sigma, x_sigma, v_old = _batch()
    v_theta = v_old + 0.05 * torch.randn_like(v_old)
    r = torch.tensor([0.0, 0.4, 1.0], dtype=torch.float64)
    out = nft_loss(v_theta, v_old, x_sigma, x0, sigma, r, beta=beta, adv_clip_max=5.0)
    want = _numpy_nft(v_theta.numpy(), v_old.numpy(), x_sigma.numpy(), x0.numpy(),
                      sigma.numpy(), r.numpy(), beta, 5.0)
    assert math.isclose(float(out.loss.detach()), want, rel_tol=1e-10)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.1])
def test_gradient_at_old_policy_is_beta_free_and_points_by_r(beta):
    x0, eps, sigma, x_sigma, v_old = _batch(1)
    v_target = eps - x0
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    c = 5.0
    v_theta = v_old.clone().requires_grad_(True)
    nft_loss(v_theta, v_old, x_sigma, x0, sigma, r, beta=beta, adv_clip_max=c).loss.backward()
    s = sigma.view(B, 1, 1, 1)
    w = (s * (v_old - v_target)).abs().flatten(1).mean(1).view(B, 1, 1, 1)  # mean|x0_hat - x0|
    expected = 2 * (2 * r.view(B, 1, 1, 1) - 1) * s ** 2 / w * (v_old - v_target) * c / D / B
    # (matching this also proves the weights are stop-grad: d w / d v_theta would add a term)
    torch.testing.assert_close(v_theta.grad, expected, rtol=1e-9, atol=1e-12)
    g = v_theta.grad
    direction = (v_target - v_old).flatten(1)
    # a descent step moves v_theta toward the target for r = 1, away for r = 0, not at all for 1/2
    assert float((-g.flatten(1)[0] * direction[0]).sum()) > 0
    assert float((-g.flatten(1)[1] * direction[1]).sum()) < 0
    assert float(g[2].abs().max()) < 1e-12 * float(g[0].abs().max())   # zero up to rounding


def test_exact_prediction_weight_is_clipped_not_a_division_by_zero():
    x0, _, sigma, x_sigma, _ = _batch(2)
    s = sigma.view(B, 1, 1, 1)
    v_exact = (x_sigma - x0) / s           # x0_hat == x0 exactly -> weight clipped to 1e-5
    v_theta = v_exact.clone().requires_grad_(True)
    out = nft_loss(v_theta, v_exact, x_sigma, x0, sigma, torch.full((B,), 0.5, dtype=torch.float64),
                   beta=1.0, adv_clip_max=5.0)
    assert math.isfinite(float(out.loss.detach())) and float(out.loss.detach()) < 1e-20


def test_reference_kl_term():
    x0, _, sigma, x_sigma, v_old = _batch(3)
    v_ref = v_old + 0.2
    r = torch.full((B,), 0.5, dtype=torch.float64)
    base = nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=1.0, adv_clip_max=5.0)
    out = nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=1.0, adv_clip_max=5.0, v_ref=v_ref,
                   ref_kl_coef=1e-2)
    assert math.isclose(float(out.ref_kl), 0.04, rel_tol=1e-9)
    assert math.isclose(float(out.loss.detach()), float(base.loss.detach()) + 1e-2 * 0.04,
                        rel_tol=1e-9)
    at_ref = nft_loss(v_ref, v_old, x_sigma, x0, sigma, r, beta=1.0, adv_clip_max=5.0,
                      v_ref=v_ref, ref_kl_coef=1.0)
    assert float(at_ref.ref_kl) == 0.0


def test_input_errors():
    x0, _, sigma, x_sigma, v_old = _batch()
    r = torch.full((B,), 0.5, dtype=torch.float64)
    with pytest.raises(ConfigError, match="v_ref"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=1.0, adv_clip_max=5.0, ref_kl_coef=1.0)
    with pytest.raises(InvalidRequestError, match="optimality"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r + 1, beta=1.0, adv_clip_max=5.0)
    with pytest.raises(InvalidRequestError, match="x0"):
        nft_loss(v_old, v_old, x_sigma, x0[:2], sigma, r, beta=1.0, adv_clip_max=5.0)
    with pytest.raises(ConfigError, match="beta"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=0.0, adv_clip_max=5.0)


def test_old_decay_schedules():
    assert [old_decay(s, OldPolicySchedule.COPY) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    lin = [old_decay(s, OldPolicySchedule.LINEAR_TO_0_5) for s in (0, 100, 499, 500, 5000)]
    assert lin == pytest.approx([0.0, 0.1, 0.499, 0.5, 0.5])
    d = [old_decay(s, OldPolicySchedule.DELAYED_LINEAR_TO_0_999) for s in (0, 74, 75, 175, 400)]
    assert d == pytest.approx([0.0, 0.0, 0.0, 0.75, 0.999])
    with pytest.raises(ValueError):
        old_decay(1, "cosine")


def test_ema_update():
    old = [torch.zeros(3), torch.ones(2, 2)]
    new = [torch.tensor([1.0, 2.0, 3.0]), torch.full((2, 2), 5.0)]
    ema_update(old, new, 0.0)                       # decay 0 == copy
    assert all(torch.equal(o, n) for o, n in zip(old, new))
    old = [torch.zeros(3)]
    ema_update(old, [torch.full((3,), 4.0)], 0.75)
    assert old[0].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError):
        ema_update(old, old, 1.5)
    with pytest.raises(InvalidRequestError):
        ema_update(old, [torch.zeros(4)], 0.5)


def test_timestep_permutation_has_no_repeats_and_uniform_may_repeat():
    from trainer.algorithms import TimestepOrder, nft_timestep_indices
    gen = torch.Generator().manual_seed(0)
    perm = nft_timestep_indices(64, 10, 9, TimestepOrder.PERMUTATION, gen)     # (draws, rows)
    assert perm.shape == (9, 64)
    for row in perm.T.tolist():                  # 9 of the 10 steps, each once (the reference)
        assert len(set(row)) == 9 and set(row) <= set(range(10))
    full = nft_timestep_indices(2000, 4, 4, TimestepOrder.PERMUTATION, gen)
    assert all(sorted(r) == [0, 1, 2, 3] for r in full.T.tolist())
    # first draw is uniform over the steps: each step ~ 500 of 2000 times
    counts = torch.bincount(full[0], minlength=4)
    assert int(counts.min()) > 400 and int(counts.max()) < 600
    uni = nft_timestep_indices(64, 10, 9, TimestepOrder.UNIFORM, gen)
    assert any(len(set(r)) < 9 for r in uni.T.tolist())
    with pytest.raises(ConfigError, match="permutation"):
        nft_timestep_indices(4, 3, 4, TimestepOrder.PERMUTATION, gen)
