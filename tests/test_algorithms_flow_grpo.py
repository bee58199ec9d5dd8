"""FlowGRPO clipped surrogate, KL terms and step selection against hand-written formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError, SamplerKind, Trajectory
from diffusion.samplers import sampler_step
from diffusion.schedule import flow_match_sigmas
from trainer.algorithms import (flow_grpo_loss, recompute_step, sde_mean_kl,
                                trainable_step_indices, transition_kl, velocity_kl, window_step)


def _numpy_ppo(log_prob, old, adv, clip, adv_max):
    a = np.clip(adv, -adv_max, adv_max)[:, None] if log_prob.ndim == 2 else np.clip(adv, -adv_max,
                                                                                  adv_max)
    rho = np.exp(log_prob - old)
    return np.mean(np.maximum(-a * rho, -a * np.clip(rho, 1 - clip, 1 + clip)))


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    adv = torch.tensor([1.5, -0.5, 7.0, -2.0])
    lp = torch.tensor([-1.2, 0.3, 2.0, -0.1], requires_grad=True)
    out = flow_grpo_loss(lp, lp.detach().clone(), adv, clip_range=1e-4, adv_clip_max=5.0)
    assert math.isclose(float(out.loss.detach()), -float(adv.clamp(-5, 5).mean()), rel_tol=1e-6)
    assert float(out.clipfrac) == 0.0 and float(out.approx_kl) == 0.0
    assert float(out.ratio_mean) == 1.0
    out.loss.backward()
    # d/d logp of -A rho / B at rho = 1 is -A / B (the policy gradient)
    torch.testing.assert_close(lp.grad, -adv.clamp(-5, 5) / 4)


def test_matches_numpy_with_ratios_outside_the_clip_range():
    gen = np.random.default_rng(1)
    old = gen.normal(size=(6, 3))
    lp = old + gen.normal(scale=0.05, size=(6, 3))     # ratios ~ exp(+-0.05), outside 1e-2
    adv = gen.normal(scale=3, size=6)
    out = flow_grpo_loss(torch.tensor(lp), torch.tensor(old), torch.tensor(adv),
                         clip_range=1e-2, adv_clip_max=5.0)
    assert math.isclose(float(out.loss), _numpy_ppo(lp, old, adv, 1e-2, 5.0), rel_tol=1e-9)
    rho = np.exp(lp - old)
    assert math.isclose(float(out.clipfrac), np.mean(np.abs(rho - 1) > 1e-2), rel_tol=1e-6)
    assert math.isclose(float(out.approx_kl), 0.5 * np.mean((lp - old) ** 2), rel_tol=1e-9)
    assert 0 < float(out.clipfrac) < 1


def test_clipping_stops_the_gradient_only_in_the_improving_direction():
    eps = 1e-3
    old = torch.zeros(4)
    # rho = e^0.01 > 1 + eps for rows 0,1; rho = e^-0.01 < 1 - eps for rows 2,3
    lp = torch.tensor([0.01, 0.01, -0.01, -0.01], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = flow_grpo_loss(lp, old, adv, clip_range=eps, adv_clip_max=5.0)
    out.loss.backward()
    rho = torch.exp(lp.detach())
    # A>0, rho high: clipped (no gradient). A<0, rho high: unclipped term is the max -> gradient.
    # A>0, rho low: unclipped is the max -> gradient. A<0, rho low: clipped (no gradient).
    expected = torch.tensor([0.0, rho[1] / 4, -rho[2] / 4, 0.0])
    torch.testing.assert_close(lp.grad, expected)
    assert float(out.clipfrac) == 1.0


def _sde_mean(x, v, sigma, sigma_next, std_dev_t):
    # FlowGRPO Euler-Maruyama mean, written out independently
    dt = sigma_next - sigma
    return x * (1 + std_dev_t ** 2 * dt / (2 * sigma)) + \
        v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt


def test_sde_mean_kl_zero_at_reference_and_closed_form():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=gen)
    v_ref = torch.randn(3, 4, 5, generator=gen)
    sigma, sigma_next, a = 0.7, 0.6, 0.7
    std = a * math.sqrt(sigma / (1 - sigma))
    mean_ref = _sde_mean(x, v_ref, sigma, sigma_next, std)
    assert torch.equal(sde_mean_kl(mean_ref, mean_ref, std), torch.zeros(3))
    coef = (1 + std ** 2 * (1 - sigma) / (2 * sigma)) * (sigma_next - sigma)
    for scale in (0.1, 0.2, 0.4):
        dv = scale * torch.randn(3, 4, 5, generator=gen)
        kl = sde_mean_kl(_sde_mean(x, v_ref + dv, sigma, sigma_next, std), mean_ref, std)
        closed = coef ** 2 * (dv ** 2).flatten(1).mean(1) / (2 * std ** 2)
        torch.testing.assert_close(kl, closed, rtol=1e-4, atol=1e-7)
    with pytest.raises(InvalidRequestError, match="std_dev_t"):
        sde_mean_kl(mean_ref, mean_ref, 0.0)


def test_velocity_kl_proportional_to_squared_distance():
    v_ref = torch.randn(2, 8)
    dv = torch.randn(2, 8)
    assert torch.equal(velocity_kl(v_ref, v_ref), torch.zeros(2))
    torch.testing.assert_close(velocity_kl(v_ref + 3 * dv, v_ref), 9 * velocity_kl(v_ref + dv,
                                                                                   v_ref))


def test_kl_enters_the_loss_with_beta():
    lp = torch.zeros(2, 3)
    kl = torch.full((2, 3), 0.5)
    out = flow_grpo_loss(lp, lp, torch.tensor([1.0, -1.0]), clip_range=1e-4, adv_clip_max=5.0,
                         kl=kl, kl_beta=0.04)
    assert math.isclose(float(out.loss), 0.04 * 0.5, rel_tol=1e-6)
    assert math.isclose(float(out.kl), 0.5)
    with pytest.raises(ConfigError, match="kl"):
        flow_grpo_loss(lp, lp, torch.zeros(2), clip_range=1e-4, adv_clip_max=5.0, kl_beta=0.1)


def test_trainable_steps_never_include_the_step_into_zero():
    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.1, 0.0])
    assert trainable_step_indices(sigmas, (0, 5)) == [0, 1, 2, 3]
    assert trainable_step_indices(sigmas, (2, 5)) == [2, 3]
    assert trainable_step_indices(sigmas, (1, 3)) == [1, 2]
    assert trainable_step_indices(sigmas, (0, 5), max_steps=2) == [0, 1]
    with pytest.raises(ConfigError, match="no trainable step"):
        trainable_step_indices(sigmas, (4, 5))
    with pytest.raises(InvalidRequestError, match="window"):
        trainable_step_indices(sigmas, (3, 6))


def test_window_step_reads_the_stored_transition():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    latents = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)   # W = 2, window (1, 3)
    traj = Trajectory(latents=latents, sigmas=sigmas, model_timesteps=sigmas[:-1] * 1000,
                      log_probs=torch.tensor([[0.1, 0.2], [0.3, 0.4]]), window=(1, 3),
                      sampler=SamplerKind.SDE, noise_level=0.7, guidance_scale=1.0,
                      seeds=(0, 1), policy_version="v0")
    s = window_step(traj, 2)
    assert torch.equal(s.x, latents[:, 1]) and torch.equal(s.x_next, latents[:, 2])
    assert (s.sigma, s.sigma_next) == (0.5, 0.25)
    assert s.old_log_prob.tolist() == pytest.approx([0.2, 0.4])
    with pytest.raises(InvalidRequestError, match="window"):
        window_step(traj, 0)


def test_recomputed_log_probs_on_a_sampled_trajectory_give_ratio_one():
    """Sample an SDE trajectory with a real conv velocity model, then recompute: rho == 1."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(2, 2, 3, padding=1)
    sigmas = flow_match_sigmas(6, shift=3.0)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 5, 5, generator=gen)
    latents, log_probs = [x], []
    with torch.no_grad():
        for j in range(6):
            sig, nxt = sigmas[j].expand(4), sigmas[j + 1].expand(4)
            out = sampler_step(SamplerKind.SDE, x, model(x), sig, nxt, 0.7,
                               torch.randn(x.shape, generator=gen))
            x = out.prev_sample
            latents.append(x)
            log_probs.append(out.log_prob)
    traj = Trajectory(latents=torch.stack(latents, 1), sigmas=sigmas,
                      model_timesteps=sigmas[:-1] * 1000, log_probs=torch.stack(log_probs, 1),
                      window=(0, 6), sampler=SamplerKind.SDE, noise_level=0.7,
                      guidance_scale=1.0, seeds=(0, 1, 2, 3), policy_version="v0")
    steps = trainable_step_indices(traj.sigmas, traj.window)
    assert steps == [0, 1, 2, 3, 4]
    recomputed = [recompute_step(traj, j, model(window_step(traj, j).x)) for j in steps]
    lp = torch.stack([r.log_prob for r in recomputed], 1)                       # (B, K)
    old = torch.stack([window_step(traj, j).old_log_prob for j in steps], 1)
    with torch.no_grad():
        ref_means = [recompute_step(traj, j, model(window_step(traj, j).x)).mean for j in steps]
    kl = torch.stack([sde_mean_kl(r.mean, m, r.std_dev_t)
                      for r, m in zip(recomputed, ref_means)], 1)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    out = flow_grpo_loss(lp, old, adv, clip_range=1e-4, adv_clip_max=5.0, kl=kl, kl_beta=0.04)
    assert float(out.clipfrac) == 0.0 and float(out.kl) == 0.0
    assert abs(float(out.ratio_mean) - 1.0) < 1e-6
    assert math.isclose(float(out.loss.detach()), -float(adv.mean()), abs_tol=1e-6)
    out.loss.backward()
    assert float(model.weight.grad.abs().sum()) > 0             # the gradient reaches the model


def _cps_mean_numpy(x, v, sigma, sigma_next, a):
    # coefficients-preserving step written out (arXiv 2509.05952), float64
    s = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
    return (1 - sigma_next) * x0_hat + math.sqrt(sigma_next ** 2 - s ** 2) * eps_hat, s


@pytest.mark.parametrize("kind", [SamplerKind.CPS, SamplerKind.SDE, SamplerKind.DANCE_SDE])
def test_transition_kl_against_the_gaussian_kl_on_the_sd3_table(kind):
    """CPS: the KL is the exact KL of the two transition Gaussians N(mu, s^2 I) (torch's own
    Normal KL on a mean written out in numpy). SDE kinds: the reference's form, the exact KL times
    (sigma - sigma_next). The former divisor std / sqrt(dt) for CPS was short by (sigma - sigma_next)."""
    from torch.distributions import Normal, kl_divergence
    sigmas = flow_match_sigmas(10, shift=3.0).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 6, 6, generator=gen, dtype=torch.float64)
    v_ref = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    v = v_ref + 0.1 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    a = 0.8 if kind is SamplerKind.CPS else 0.7
    for j in range(9):                                   # every trainable step (not into 0)
        sig, nxt = float(sigmas[j]), float(sigmas[j + 1])
        rows = lambda t: torch.full((3,), t, dtype=torch.float32)
        out = sampler_step(kind, x.float(), v.float(), rows(sig), rows(nxt), a, None,
                           prev_sample=x.float())
        ref = sampler_step(kind, x.float(), v_ref.float(), rows(sig), rows(nxt), a, None,
                           prev_sample=x.float())
        kl = transition_kl(out, ref).double()
        if kind is SamplerKind.CPS:
            mu, s = _cps_mean_numpy(x.numpy(), v.numpy(), sig, nxt, a)
            mu_ref, _ = _cps_mean_numpy(x.numpy(), v_ref.numpy(), sig, nxt, a)
            exact = kl_divergence(Normal(torch.tensor(mu), s),
                                  Normal(torch.tensor(mu_ref), s)).flatten(1).mean(1)
            torch.testing.assert_close(kl, exact, rtol=2e-4, atol=1e-9)
            buggy = sde_mean_kl(out.mean, ref.mean, out.std / out.sqrt_dt).double()
            torch.testing.assert_close(buggy / kl, torch.full((3,), sig - nxt,
                                                              dtype=torch.float64), rtol=1e-4,
                                       atol=0)
        else:
            s = out.std.double()[:, None, None, None]
            exact = kl_divergence(Normal(out.mean.double(), s),
                                  Normal(ref.mean.double(), s)).flatten(1).mean(1)
            torch.testing.assert_close(kl, exact * (sig - nxt), rtol=2e-4, atol=1e-9)
    with pytest.raises(InvalidRequestError, match="noise scales"):
        other = sampler_step(kind, x.float(), v.float(), rows(sig), rows(nxt), a / 2, None,
                             prev_sample=x.float())
        transition_kl(out, other)
