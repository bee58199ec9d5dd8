"""AWM (advantage-weighted matching) against its reference code on the same random inputs.

Excerpts cut to the lines used from X-GenGroup/Flow-Factory
a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c: src/flow_factory/trainers/awm.py
(AWMTrainer.compute_weighted_log_prob; the noising, target and clipped loss of
AWMTrainer.optimize / _compute_awm_output) and src/flow_factory/utils/noise_schedule.py
(flow_match_sigma, TIMESTEP_MAX = 1000).
"""
from __future__ import annotations

import pytest
import torch

from contract import ConfigError, InvalidRequestError
from trainer.algorithms import AWMWeighting, awm_log_prob, awm_loss

TIMESTEP_MAX = 1000.0


# ---- excerpts of the reference code -------------------------------------------------------
def flow_match_sigma(t_scheduler):
    return (t_scheduler / TIMESTEP_MAX).clamp(0.0, 1.0)


def ref_compute_weighted_log_prob(model_output, target, timestep, weighting='Uniform',
                                  ghuber_power=0.25):
    model_output = model_output.double()
    target = target.double()
    log_prob = -(model_output - target) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = flow_match_sigma(timestep.view(-1))
    if weighting == 'Uniform':
        pass
    elif weighting == 't':
        log_prob = log_prob * t
    elif weighting == 't**2':
        log_prob = log_prob * t ** 2
    elif weighting == 'huber':
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == 'ghuber':
        eps = torch.tensor(1e-10, device=log_prob.device, dtype=log_prob.dtype)
        log_prob = -(
            torch.pow(-log_prob + eps, ghuber_power) - torch.pow(eps, ghuber_power)
        ) * t / ghuber_power
    return log_prob.float()


def ref_awm_step(noise_pred, old_noise_pred, clean_latents, noise, t_flat, adv, weighting,
                 adv_clip_range, ratio_clip_range):
    target = noise - clean_latents
    old_log_prob = ref_compute_weighted_log_prob(old_noise_pred, target, t_flat, weighting)
    log_prob = ref_compute_weighted_log_prob(noise_pred, target, t_flat, weighting)
    adv = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + ratio_clip_range[0], 1.0 + ratio_clip_range[1])
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)), old_log_prob


WEIGHTINGS = {AWMWeighting.UNIFORM: 'Uniform', AWMWeighting.SIGMA: 't',
              AWMWeighting.SIGMA_SQUARED: 't**2', AWMWeighting.HUBER: 'huber',
              AWMWeighting.GHUBER: 'ghuber'}


def _draw(seed: int, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, 4, 8, 8, generator=g)
    noise = torch.randn(rows, 4, 8, 8, generator=g)
    sigma = torch.rand(rows, generator=g)
    old_v = noise - x0 + 0.5 * torch.randn(rows, 4, 8, 8, generator=g)
    v = old_v + 0.01 * torch.randn(rows, 4, 8, 8, generator=g)
    adv = 3.0 * torch.randn(rows, generator=g)
    return x0, noise, sigma, v, old_v, adv


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighting", list(AWMWeighting))
def test_awm_equals_flow_factory(seed, weighting):
    x0, noise, sigma, v, old_v, adv = _draw(seed)
    ref_w = WEIGHTINGS[weighting]
    t_flat = sigma * TIMESTEP_MAX               # the reference's scheduler-scale timestep
    sigma_ref = flow_match_sigma(t_flat)        # the sigma its noising and weighting use
    mine_lp = awm_log_prob(v, x0, noise, sigma_ref, weighting)
    ref_lp = ref_compute_weighted_log_prob(v, noise - x0, t_flat, ref_w)
    torch.testing.assert_close(mine_lp, ref_lp, rtol=1e-5, atol=0)
    for clip in (1e-4, 0.05):
        v_mine = v.clone().requires_grad_()
        v_ref = v.clone().requires_grad_()
        old = awm_log_prob(old_v, x0, noise, sigma_ref, weighting)
        mine = awm_loss(v_mine, old, x0, noise, sigma_ref, adv, clip_range=clip,
                        adv_clip_max=2.0, weighting=weighting)
        ref, ref_old = ref_awm_step(v_ref, old_v, x0, noise, t_flat, adv, ref_w, (-2.0, 2.0),
                                    (-clip, clip))
        torch.testing.assert_close(old, ref_old, rtol=1e-5, atol=0)
        torch.testing.assert_close(mine.loss, ref, rtol=1e-5, atol=0)
        mine.loss.backward()
        ref.backward()
        torch.testing.assert_close(v_mine.grad, v_ref.grad, rtol=1e-5, atol=1e-9)
        assert float(v_mine.grad.abs().max()) > 0


def test_awm_log_prob_is_the_negative_flow_matching_loss():
    # uniform weighting: minus the pretraining loss; at the exact target velocity it is 0
    x0, noise, sigma, v, _, _ = _draw(5)
    lp = awm_log_prob(v, x0, noise, sigma)
    torch.testing.assert_close(lp, -((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3)))
    assert torch.equal(awm_log_prob(noise - x0, x0, noise, sigma), torch.zeros(6))


def test_awm_refuses_bad_input():
    x0, noise, sigma, v, old_v, adv = _draw(0)
    with pytest.raises(InvalidRequestError) as e:
        awm_log_prob(v, x0, noise, sigma * 2 + 1)
    assert e.value.field == "sigma"
    with pytest.raises(InvalidRequestError) as e:
        awm_log_prob(v[:, :2], x0, noise, sigma)
    assert e.value.field == "velocity"
    with pytest.raises(ConfigError) as e:
        awm_log_prob(v, x0, noise, sigma, AWMWeighting.GHUBER, ghuber_power=0.0)
    assert e.value.field == "ghuber_power"
    with pytest.raises(ValueError):
        awm_log_prob(v, x0, noise, sigma, "t**2")
