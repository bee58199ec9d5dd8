"""GRPO-Guard against its reference code on the same random inputs, and one FlowGRPO step with
the guarded ratio on tiny_t2i through the real embedded engine and learner (no Ray).

Excerpts are cut to the lines used from:
  verl-project/verl-omni a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
    verl_omni/trainer/diffusion/diffusion_algos.py, GRPOGuardLoss.compute_loss;
  X-GenGroup/Flow-Factory a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
    src/flow_factory/trainers/grpo.py, GRPOGuardTrainer.optimize (the loss lines).
"""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, ConfigError, InvalidRequestError
from rollout.engine import EmbeddedEngine
from tests.test_trainer_local import _grads_of, _outputs, _rollout
from trainer.algorithms import PolicyRatio, grpo_guard_loss, recompute_step
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import UPDATES


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


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(samples_per_prompt=4, prompts_per_step=2,
                        sampler=SamplerSettings(num_steps=4, window=(1, 2)))
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    yield adapter, engine, cfg, learner
    asyncio.run(engine.shutdown())


def test_guard_step_on_tiny_t2i_scales_flow_grpos_gradient_on_policy(tiny):
    """At the old policy (the step's own pre-step weights) the mean drift is 0 with zero gradient
    and the guarded ratio is exp(s * 0) = 1, so GRPO-Guard's gradient is FlowGRPO's times s
    (the step's std_dev_t * sqrt_dt), divided by sqrt_dt^2 when reweighted; one real step then
    moves the adapter."""
    adapter, engine, base, learner = tiny
    tensors, scale = learner.export()
    engine.load_lora("g-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 5))
    requests = make_requests(adapter, prompts, base.sampler, 4, 0, "g-v0")
    results = _rollout(adapter, engine, learner, "g-v0", requests, prompts)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    batch = build_batch(learner, prompts, _outputs(requests, results, rewards),
                        [r.sampling for r in requests])
    make = lambda **grpo: TrainerConfig(
        algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=4, sampler=base.sampler,
        flow_grpo={"old_log_probs": "recompute", "clip_range": 0.2, **grpo})
    update = UPDATES[Algorithm.FLOW_GRPO]
    plain, m_plain = _grads_of(update, learner, batch, make())
    guard, m_guard = _grads_of(update, learner, batch, make(ratio="grpo_guard",
                                                            guard_reweight=False))
    reweighted, _ = _grads_of(update, learner, batch, make(ratio="grpo_guard"))
    traj = batch.trajectory
    step = recompute_step(traj, 1, torch.zeros_like(traj.latents[:, 0]))
    s, dt = float(step.std_dev_t[0] * step.sqrt_dt[0]), float(step.sqrt_dt[0] ** 2)
    assert 0 < s < 1 and abs(m_guard["ratio_mean"] - 1.0) < 1e-5
    assert any(float(g.abs().max()) > 0 for g in plain)
    for p, g, r in zip(plain, guard, reweighted):       # atol: sums that cancel to ~0
        tol = 1e-5 * float(p.abs().max()) * s
        torch.testing.assert_close(g, s * p, rtol=1e-4, atol=tol)
        torch.testing.assert_close(r, s * p / dt, rtol=1e-4, atol=tol / dt)
    before = [p.detach().clone() for p in learner.params]
    metrics = update(learner, batch, make(ratio="grpo_guard"), torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
