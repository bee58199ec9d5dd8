"""GRPO-Guard against its reference code on the same random inputs (its step on tiny_t2i:
tests/test_trainer_algorithm_steps.py).

Excerpts are cut to the lines used from:
  verl-project/verl-omni a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
    verl_omni/trainer/diffusion/diffusion_algos.py, GRPOGuardLoss.compute_loss;
  X-GenGroup/Flow-Factory a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
    src/flow_factory/trainers/grpo.py, GRPOGuardTrainer.optimize (the loss lines).
"""
from __future__ import annotations

import pytest
import torch

from contract import ConfigError, InvalidRequestError
from trainer.algorithms import PolicyRatio, grpo_guard_loss
from trainer.config import load_trainer_config


# ---- excerpts of the reference code -------------------------------------------------------
def ref_verl_omni_grpo_guard(old_log_prob, log_prob, advantages, old_prev_sample_mean,
                             prev_sample_mean, std_dev_t, sqrt_dt, clip_ratio, adv_clip_max):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if mean_diff_sq.ndim > 1:
        mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale**2)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp((log_ratio + ratio_mean_bias) * scale)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_elem_loss = torch.maximum(unclipped_loss, clipped_loss)
    pg_loss = torch.mean(per_elem_loss) / (sqrt_dt_mean**2)
    pg_clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_ratio).float())
    return pg_loss, pg_clipfrac, ratio.mean()


def ref_flow_factory_grpo_guard(log_prob, old_log_prob, next_latents_mean, old_next_latents_mean,
                                adv, std_dev_t, dt, adv_clip_range, ratio_clip_range):
    adv = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (next_latents_mean - old_next_latents_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor))
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + ratio_clip_range[0], 1.0 + ratio_clip_range[1])
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def _inputs(seed: int, rows: int = 6):
    """One step's tensors as the trainer has them: rows share sigma, so std_dev_t and sqrt_dt
    are one value repeated (the reference reduces them to their mean)."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(rows, 4, 8, 8, generator=g)
    old_mean = mean + 0.02 * torch.randn(rows, 4, 8, 8, generator=g)
    log_prob = torch.randn(rows, generator=g) * 0.5
    old_log_prob = log_prob + 0.3 * torch.randn(rows, generator=g)
    adv = torch.randn(rows, generator=g) * 3.0
    std_dev_t = torch.full((rows,), 0.3 + float(torch.rand((), generator=g)))
    sqrt_dt = torch.full((rows,), 0.1 + 0.4 * float(torch.rand((), generator=g)))
    return log_prob, old_log_prob, mean, old_mean, adv, std_dev_t, sqrt_dt


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip_range", [1e-4, 0.2])
def test_guard_loss_equals_verl_omni_and_flow_factory(seed, clip_range):
    log_prob, old_log_prob, mean, old_mean, adv, std_dev_t, sqrt_dt = _inputs(seed)
    mine = grpo_guard_loss(log_prob.requires_grad_(), old_log_prob, mean.requires_grad_(),
                           old_mean, adv, std_dev_t, sqrt_dt, clip_range=clip_range,
                           adv_clip_max=2.0, reweight=True)
    lp_ref, mean_ref = log_prob.detach().clone().requires_grad_(), mean.detach().clone()
    mean_ref.requires_grad_()
    ref_loss, ref_clipfrac, ref_ratio = ref_verl_omni_grpo_guard(
        old_log_prob, lp_ref, adv, old_mean, mean_ref, std_dev_t, sqrt_dt, clip_range, 2.0)
    torch.testing.assert_close(mine.loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(mine.clipfrac, ref_clipfrac)
    torch.testing.assert_close(mine.ratio_mean, ref_ratio, rtol=1e-5, atol=0)
    mine.loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(log_prob.grad, lp_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mean.grad, mean_ref.grad, rtol=1e-5, atol=1e-9)
    assert float(log_prob.grad.abs().max()) > 0        # some rows are not clipped
    # Flow-Factory: the same ratio, no 1 / dt reweighting of the loss
    plain = grpo_guard_loss(log_prob.detach(), old_log_prob, mean.detach(), old_mean, adv,
                            std_dev_t, sqrt_dt, clip_range=clip_range, adv_clip_max=2.0,
                            reweight=False)
    ff = ref_flow_factory_grpo_guard(log_prob.detach(), old_log_prob, mean.detach(), old_mean,
                                     adv, std_dev_t, -sqrt_dt ** 2, (-2.0, 2.0),
                                     (-clip_range, clip_range))
    torch.testing.assert_close(plain.loss, ff, rtol=1e-5, atol=0)


def test_guard_refuses_bad_input_before_work():
    log_prob, old_log_prob, mean, old_mean, adv, std_dev_t, sqrt_dt = _inputs(0)
    with pytest.raises(InvalidRequestError) as e:
        grpo_guard_loss(log_prob, old_log_prob, mean, old_mean, adv, std_dev_t,
                        torch.zeros_like(sqrt_dt), clip_range=0.2, adv_clip_max=2.0)
    assert e.value.field == "scale"                      # a deterministic step has no ratio
    with pytest.raises(InvalidRequestError) as e:
        grpo_guard_loss(log_prob, old_log_prob, mean, old_mean[:, :2], adv, std_dev_t, sqrt_dt,
                        clip_range=0.2, adv_clip_max=2.0)
    assert e.value.field == "old_mean"
    with pytest.raises(ConfigError) as e:
        grpo_guard_loss(log_prob, old_log_prob, mean, old_mean, adv, std_dev_t, sqrt_dt,
                        clip_range=0.0, adv_clip_max=2.0)
    assert e.value.field == "clip_range"


def test_guard_is_a_validated_flow_grpo_option():
    cfg = load_trainer_config({"algorithm": "flow_grpo", "flow_grpo": {"ratio": "grpo_guard"}})
    assert cfg.flow_grpo.ratio is PolicyRatio.GRPO_GUARD and cfg.flow_grpo.guard_reweight
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"algorithm": "flow_grpo", "flow_grpo": {"ratio": "guard"}})
    assert "flow_grpo.ratio" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"algorithm": "flow_grpo", "flow_grpo": {"guard_reweight": False}})
    assert "guard_reweight" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"algorithm": "nft", "flow_grpo": {"ratio": "grpo_guard"}})
    assert "grpo_guard" in str(e.value)
