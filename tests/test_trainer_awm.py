"""AWM (advantage-weighted matching) as a trainer algorithm: its validated options and one
in-process step through the real embedded rollout engine and learner (no Ray) on tiny_t2i and
on the tiny SD3 checkpoint. The loss itself is checked against Flow-Factory in
tests/test_algorithms_awm.py; here the step's gradient is checked against the derivation: at
the pre-step weights the ratio is 1, so the clipped surrogate's gradient is that of
-mean_rows,draws(clip(A) log p_theta), log p_theta from `awm_log_prob` at the step's own draws."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.registry import get_family
from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, ConfigError, SamplerKind
from rollout.engine import EmbeddedEngine
from tests.test_trainer_local import _grads_of, _outputs, _rollout
from trainer.algorithms import awm_log_prob
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.lora import PolicyRole
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.train_noise import Draw, row_randn, row_timesteps
from trainer.updates import UPDATES, plan_update


def _setup(adapter, seed: int):
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(samples_per_prompt=4, prompts_per_step=2)
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return engine, learner


def _batch(adapter, engine, learner, settings, version, caption_seed):
    tensors, scale = learner.export()
    engine.load_lora(version, tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, caption_seed))
    requests = make_requests(adapter, prompts, settings, 4, 0, version)
    results = _rollout(adapter, engine, learner, version, requests, prompts)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=tuple(range(1, e.latents[
        "image_latent"].data.ndim))) - 0.1).abs()).tolist() for e in results]
    return build_batch(learner, prompts, _outputs(requests, results, rewards),
                       [r.sampling for r in requests])


def _awm_cfg(settings, **awm):
    return TrainerConfig(algorithm=Algorithm.AWM, samples_per_prompt=4, sampler=settings,
                         awm={"clip_range": 0.2, "train_timesteps": 2, **awm})


def _derived_grads(learner, batch, cfg):
    """The gradient of -mean(clip(A) log p_theta) at the plan's own draws, by hand."""
    plan = plan_update(Algorithm.AWM, batch, cfg, torch.Generator().manual_seed(0))
    c, b = cfg.awm, plan.batch
    sigmas = learner.family.sigmas(b.sampling)[:-1]
    order = row_timesteps(plan.noise_seed, b.seeds, len(sigmas), c.train_timesteps,
                          c.timesteps, Draw.AWM_TIMESTEPS)
    a = plan.values.clamp(-c.adv_clip_max, c.adv_clip_max)
    total = 0.0
    for k in range(c.train_timesteps):
        sigma = sigmas[order[k]]
        eps = row_randn(plan.noise_seed, b.seeds, Draw.AWM_NOISE, k, b.x0.shape[1:])
        s = sigma.reshape(-1, *([1] * (b.x0.ndim - 1)))
        x_sigma = (1 - s) * b.x0 + s * eps
        v = learner.velocity(x_sigma, sigma, b.cond, PolicyRole.CURRENT, media=b.inputs)
        log_p = awm_log_prob(v, b.x0, eps, sigma, c.weighting, c.ghuber_power)
        total = total + (-(a * log_p)).mean() / c.train_timesteps
    grads = torch.autograd.grad(total, learner.params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(learner.params, grads)]


def _check_step(learner, batch, settings):
    cfg = _awm_cfg(settings)
    got, metrics = _grads_of(UPDATES[Algorithm.AWM], learner, batch, cfg)
    want = _derived_grads(learner, batch, cfg)
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-6 and metrics["clipfrac"] == 0.0
    assert any(float(g.abs().max()) > 0 for g in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max()) + 1e-12)
    # a different weighting is a different gradient (the option reaches the loss)
    other, _ = _grads_of(UPDATES[Algorithm.AWM], learner, batch,
                         _awm_cfg(settings, weighting="sigma2"))
    assert any(not torch.allclose(a, b) for a, b in zip(got, other))
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.AWM](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_awm_options_are_validated():
    cfg = load_trainer_config({"algorithm": "awm", "awm": {"weighting": "ghuber",
                                                          "ghuber_power": 0.5}})
    assert cfg.algorithm is Algorithm.AWM and cfg.awm.ghuber_power == 0.5
    bad = [({"awm": {"weighting": "uniform", "ghuber_power": 0.5}}, "ghuber_power"),
           ({"awm": {"weighting": "cubic"}}, "awm.weighting"),
           ({"awm": {"clip_range": 0}}, "awm.clip_range"),
           ({"awm": {"train_timesteps": 11}}, "awm.train_timesteps=11")]
    for extra, needle in bad:
        with pytest.raises(ConfigError) as e:
            load_trainer_config({"algorithm": "awm", **extra})
        assert needle in str(e.value)


def test_awm_step_on_tiny_t2i_is_the_derived_gradient():
    torch.set_num_threads(1)
    adapter = TinyT2IFamily()
    engine, learner = _setup(adapter, 3)
    try:
        settings = SamplerSettings(num_steps=4, window=(1, 2))
        batch = _batch(adapter, engine, learner, settings, "awm-v0", 11)
        _check_step(learner, batch, settings)
    finally:
        asyncio.run(engine.shutdown())


def test_awm_step_on_the_tiny_sd3_checkpoint(tiny_checkpoint):
    """AWM needs no trajectory: the rollout here is deterministic (ODE)."""
    torch.set_num_threads(1)
    adapter = get_family("sd3", tiny_checkpoint("sd3"), {"max_sequence_length": 32})
    engine, learner = _setup(adapter, 4)
    try:
        settings = SamplerSettings(sampler=SamplerKind.ODE, num_steps=3, height=16, width=16)
        batch = _batch(adapter, engine, learner, settings, "awm-sd3-v0", 12)
        assert batch.trajectory is None or batch.trajectory.log_probs.shape[1] == 0
        _check_step(learner, batch, settings)
    finally:
        asyncio.run(engine.shutdown())
