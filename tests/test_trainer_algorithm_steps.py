"""One in-process training step of each FlowGRPO variant on tiny_t2i through the real embedded
rollout engine and learner (no Ray): GRPO-Guard's ratio, MixGRPO's sliding SDE window and
MixGRPO-Flash's higher-order solver after it."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, ConfigError
from diffusion import flash_schedule, sliding_sde_window
from rollout.engine import EmbeddedEngine
from tests.test_trainer_local import _grads_of, _outputs, _rollout
from trainer import checks
from trainer.algorithms import recompute_step
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import UPDATES


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


def test_mixgrpo_sliding_window_is_a_validated_sampler_option():
    cfg = load_trainer_config({"algorithm": "flow_grpo", "steps": 8, "sampler": {
        "num_steps": 6, "sliding_window": {"size": 2, "shift_every": 4}}})
    assert cfg.sampler.sliding_window.stride is None
    bad = [({"num_steps": 6, "sliding_window": {"size": 5}}, "sliding_window.size"),
           ({"num_steps": 6, "window": [0, 2], "sliding_window": {}}, "one of window"),
           ({"num_steps": 6, "sliding_window": {"size": 2, "shift_every": 1}}, "steps=8")]
    for sampler, needle in bad:
        with pytest.raises(ConfigError) as e:
            load_trainer_config({"algorithm": "flow_grpo", "steps": 8, "sampler": sampler})
        assert needle in str(e.value)
    rolled = load_trainer_config({"algorithm": "flow_grpo", "steps": 8, "sampler": {
        "num_steps": 6, "sliding_window": {"size": 3, "shift_every": 1, "roll_back": True}}})
    assert rolled.sampler.sliding_window.roll_back


def test_mixgrpo_step_trains_the_window_of_its_optimizer_step(tiny):
    """Every request of optimizer step k samples SDE inside sliding_sde_window(k) and ODE
    outside it; the FlowGRPO update trains exactly those steps and moves the adapter."""
    adapter, engine, _, learner = tiny
    settings = SamplerSettings(num_steps=6, sliding_window={"size": 2, "shift_every": 1,
                                                            "stride": 1})
    cfg = TrainerConfig(algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=4, sampler=settings,
                        steps=3, advantage={"zero_advantage": "keep"})
    tensors, scale = learner.export()
    engine.load_lora("m-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 7))
    step = 2
    requests = make_requests(adapter, prompts, settings, 4, 0, "m-v0", step=step)
    assert [r.sampling.sde_window for r in requests] == [(2, 4), (2, 4)]
    assert sliding_sde_window(step, 6, 2, 1, 1) == (2, 4)
    results = _rollout(adapter, engine, learner, "m-v0", requests, prompts)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    batch = build_batch(learner, prompts, _outputs(requests, results, rewards),
                        [r.sampling for r in requests])
    assert batch.trajectory.window == (2, 4) and batch.trajectory.latents.shape[1] == 3
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["trained_window_steps"] == 2.0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_mixgrpo_flash_step_samples_the_compressed_schedule_and_trains_its_window(tiny):
    """MixGRPO-Flash: every request of optimizer step k samples SDE in the sliding window and
    DPM-Solver++(2M) after it on the compressed table the family builds; the learner's
    recomputed log-probs equal the rollout's on that table, and the step trains the window."""
    adapter, engine, _, learner = tiny
    settings = SamplerSettings(num_steps=8, flash_compress=0.5,
                               sliding_window={"size": 2, "shift_every": 1, "stride": 1})
    cfg = TrainerConfig(algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=4, sampler=settings,
                        steps=3, advantage={"zero_advantage": "keep"})
    tensors, scale = learner.export()
    engine.load_lora("f-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 8))
    requests = make_requests(adapter, prompts, settings, 4, 0, "f-v0", step=1)
    assert all(r.sampling.sde_window == (1, 3) and r.sampling.flash_compress == 0.5
               for r in requests)
    results = _rollout(adapter, engine, learner, "f-v0", requests, prompts)
    plain = make_requests(adapter, prompts, settings.model_copy(update={"flash_compress": None}),
                          4, 0, "f-v0", step=1)
    euler = _rollout(adapter, engine, learner, "f-v0", plain, prompts)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    batch = build_batch(learner, prompts, _outputs(requests, results, rewards),
                        [r.sampling for r in requests])
    traj = batch.trajectory
    nominal = adapter.sigmas(requests[0].sampling)
    want = flash_schedule(nominal, 3, 0.5, adapter.schedule_shift(requests[0].sampling))
    assert traj.sigmas.shape == (3 + 3,) and torch.allclose(traj.sigmas, want)
    assert traj.window == (1, 3) and traj.latents.shape[1] == 3
    assert not torch.allclose(results[0].latents["image_latent"].data,
                              euler[0].latents["image_latent"].data, atol=1e-4)
    parity = checks.logprob_mismatch(learner, traj, batch.cond, {"f-v0": tensors}.__getitem__,
                                     batch.versions, 1e-4)
    assert parity["logprob_ratio_err_max"] <= 1e-4
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["trained_window_steps"] == 2.0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_flash_options_are_validated():
    cfg = load_trainer_config({"algorithm": "flow_grpo", "steps": 2, "sampler": {
        "num_steps": 8, "window": [1, 3], "flash_compress": 0.4}})
    assert cfg.sampler.flash_compress == 0.4
    bad = [({"num_steps": 8, "flash_compress": 0.5}, "ending at step 7"),       # default window
           ({"num_steps": 8, "window": [1, 3], "flash_compress": 0.1}, "flash_compress=0.1"),
           ({"num_steps": 8, "sampler": "ode", "flash_compress": 0.4}, "flash_compress"),
           ({"num_steps": 8, "window": [1, 3], "flash_compress": 1.5}, "flash_compress")]
    for sampler, needle in bad:
        with pytest.raises(ConfigError) as e:
            load_trainer_config({"algorithm": "nft" if sampler.get("sampler") else "flow_grpo",
                                 "steps": 2, "sampler": sampler})
        assert needle in str(e.value)
