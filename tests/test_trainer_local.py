"""Trainer pieces against the real embedded rollout engine (no Ray): updates of each algorithm,
log-prob parity at the sampled version, the LoRA-map check, stale-row filtering, config rules."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import SHIPPED_WEIGHTS, TinyT2IFamily
from contract import (Algorithm, ConfigError, RewardReport, RolloutOutput, SamplerKind,
                      StartupCheckError, TimeConvention)
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from trainer import checks
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.loop import stale_rows
from trainer.prompts import captions, make_requests, probe_clean_latents
from trainer.rollout_batch import build_batch
from trainer.updates import UPDATES


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(samples_per_prompt=4, prompts_per_step=2,
                        sampler=SamplerSettings(num_steps=4, window=(0, 2)))
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():   # a nonzero trained adapter, so versions differ from the base model
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    yield adapter, engine, cfg, learner
    asyncio.run(engine.shutdown())


def _rollout(adapter, engine, learner, version, requests, prompts):
    async def go():
        return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                    ("image_latent",), {}, version))
                for r, p in zip(requests, prompts)]
    return asyncio.run(go())


def _outputs(requests, results, rewards):
    return [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                          r.sampling.seeds, rewards=RewardReport({}, tuple(rw), {}))
            for r, e, rw in zip(requests, results, rewards)]


def test_updates_and_logprob_parity(setup):
    adapter, engine, cfg, learner = setup
    tensors, scale = learner.export()
    engine.load_lora("t-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 0))
    requests = make_requests(adapter, prompts, cfg.sampler, 4, 0, "t-v0")
    results = _rollout(adapter, engine, learner, "t-v0", requests, prompts)
    # rewards: distance of the sample's mean to a target, a real function of the samples
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    batch = build_batch(learner, prompts, _outputs(requests, results, rewards),
                        [r.sampling for r in requests])
    assert batch.x0.shape == (8, 4, 8, 8) and batch.trajectory.latents.shape[1] == 3
    parity = checks.logprob_mismatch(learner, batch.trajectory, batch.cond, {"t-v0": tensors}
                                     .__getitem__, batch.versions, 1e-4)
    assert parity["logprob_ratio_err_max"] <= 1e-4
    # weights other than the sampled version's -> the parity check fails
    wrong = {k: v * 1.5 for k, v in tensors.items()}
    with pytest.raises(StartupCheckError) as e:
        checks.logprob_mismatch(learner, batch.trajectory, batch.cond, lambda v: wrong,
                                batch.versions, 1e-4)
    assert e.value.field == "log_prob"
    before = [p.detach().clone() for p in learner.params]
    for algorithm in Algorithm:
        metrics = UPDATES[algorithm](learner, batch, cfg, torch.Generator().manual_seed(0))
        assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_lora_map_check_passes_and_fails_when_broken(setup):
    adapter, engine, cfg, learner = setup
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 5, held_out=True))
    probe, scale = checks.probe_lora(learner, seed=3)
    swapped = dict(probe)   # a broken map: q's LoRA lands on k and vice versa
    for key in [k for k in probe if ".attn.to_q." in k]:
        swapped[key], swapped[key.replace("to_q", "to_k")] = probe[key.replace("to_q", "to_k")], \
            probe[key]
    engine.load_lora("t-probe", probe, scale)
    engine.load_lora("t-probe-broken", swapped, scale)
    reqs = {v: make_requests(adapter, prompts, cfg.sampler, 2, 7, v, sampler=SamplerKind.ODE,
                             num_steps=3) for v in ("t-probe", "t-probe-broken", "base")}
    states = {v: torch.cat([e.latents["image_latent"].data for e in
                            _rollout(adapter, engine, learner, v, r, prompts)])
              for v, r in reqs.items()}
    seeds = [s for r in reqs["base"] for s in r.sampling.seeds]
    local = checks.sample_local_ode(learner, checks.merged_copy(learner, probe, scale), prompts,
                                    seeds, 3, reqs["base"][0].sampling)
    report = checks.check_lora_map(states["t-probe"], states["base"], local, 1e-4)
    assert report["lora_probe_max_diff"] <= 1e-4 < report["lora_probe_effect"]
    with pytest.raises(StartupCheckError, match="differently"):
        checks.check_lora_map(states["t-probe-broken"], states["base"], local, 1e-4)
    with pytest.raises(StartupCheckError, match="matched nothing"):
        checks.check_lora_map(states["base"], states["base"], states["base"], 1e-4)


def test_time_convention_check_fails_when_flip_removed(setup, monkeypatch):
    assert SHIPPED_WEIGHTS.is_dir(), f"package data missing: {SHIPPED_WEIGHTS}"
    adapter, _, _, learner = setup
    x0, prompts = probe_clean_latents(PromptSource.SHAPES, adapter)
    report = checks.check_time_convention(learner, x0, prompts)
    assert min(v for k, v in report.items() if k.startswith("cos_declared")) > 0.3
    monkeypatch.setattr(adapter.denoiser, "time_convention", TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as e:
        checks.check_time_convention(learner, x0, prompts)
    assert e.value.field == "adapter.time_convention"


def test_stale_rows_and_config_rules():
    published = ["r/v0", "r/v1", "r/v2"]
    assert stale_rows(["r/v2", "r/v1", "r/v0", "x/v9"], published, 1) == [False, False, True, True]
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"pipeline": {"mode": "async", "max_staleness": 0}})
    assert e.value.field == "pipeline"
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"algorithm": "flow_grpo", "sampler": {"sampler": "ode"}})
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"nft": {"betta": 1.0}})
    assert e.value.field == "nft.betta"
    cfg = load_trainer_config("configs/train_tiny_t2i.yaml", {"steps": 3})
    assert cfg.steps == 3 and cfg.graph_config().adapter == "tiny_t2i"


def test_token_id_check():
    adapter = TinyT2IFamily()
    held = adapter.conditioner.tokenize(["a red circle at the top left on a black background"])
    names = adapter.spec.encoder_names
    out = lambda ids: RolloutOutput("r0", {}, None, "v0", (0,), metadata={} if ids is None
                                    else {"encoded_token_ids": {"minilm": ids}})
    assert checks.check_token_ids(held, [out(held[0].token_ids)], names) == 1
    altered = held[0].token_ids[:-2] + (999,) + held[0].token_ids[-1:]
    with pytest.raises(StartupCheckError) as e:
        checks.check_token_ids(held, [out(altered)], names)
    assert e.value.field == "encoded_token_ids.minilm" and e.value.actual == list(altered)
    with pytest.raises(StartupCheckError, match="did not report"):
        checks.check_token_ids(held, [out(None)])


def _grads_of(update, learner, batch, cfg):
    """Run one update with the optimizer step replaced by a capture of the gradients."""
    captured = []

    def capture():
        captured.append([p.grad.detach().clone() for p in learner.params])
        for p in learner.params:
            p.grad = None
        return 1.0
    real, learner.step = learner.step, capture
    try:
        metrics = update(learner, batch, cfg, torch.Generator().manual_seed(0))
    finally:
        learner.step = real
    return captured[0] if captured else None, metrics


def _fast_batch(adapter, engine, learner, settings, tied_first=False):
    from trainer.prompts import request_window
    seed = next(s for s in range(100) if request_window(settings, s, 0)
                != request_window(settings, s, 1))
    tensors, scale = learner.export()
    engine.load_lora("t-fast", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 3))
    requests = make_requests(adapter, prompts, settings, 4, seed, "t-fast")
    results = _rollout(adapter, engine, learner, "t-fast", requests, prompts)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    if tied_first:
        rewards[0] = [0.5] * 4
    return build_batch(learner, prompts, _outputs(requests, results, rewards),
                       [r.sampling for r in requests]), requests


def test_flow_grpo_fast_windows_per_group_and_row_share_weighting(setup):
    """Flow-GRPO-Fast: one random 1-step SDE window per prompt group; each row trains only its
    group's window step, and the loss is the row-weighted mean over window groups."""
    adapter, engine, _, learner = setup
    settings = SamplerSettings(num_steps=4, window_size=1, window_range=(0, 3))
    cfg = TrainerConfig(algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=4, sampler=settings,
                        advantage={"std": "group", "zero_advantage": "keep"})
    batch, requests = _fast_batch(adapter, engine, learner, settings)
    windows = [r.sampling.sde_window for r in requests]
    assert windows[0] != windows[1] and all(w[1] - w[0] == 1 and w[1] <= 3 for w in windows)
    assert batch.trajectory is None and len(batch.window_groups) == 2
    assert all(t.latents.shape[1] == 2 for _, t in batch.window_groups)     # one step each
    full, metrics = _grads_of(UPDATES[Algorithm.FLOW_GRPO], learner, batch, cfg)
    assert metrics["trained_window_steps"] == 1.0 and metrics["window_groups"] == 2.0
    parts = [_grads_of(UPDATES[Algorithm.FLOW_GRPO], learner, batch.select(rows), cfg)[0]
             for rows, _ in batch.window_groups]
    for g, a, b in zip(full, *parts):
        torch.testing.assert_close(g, 0.5 * a + 0.5 * b, rtol=1e-4, atol=1e-9)
    assert any(float(g.abs().max()) > 0 for g in full)


def test_zero_advantage_rows_follow_each_algorithms_reference(setup):
    """A tied group (advantages all 0): FlowGRPO leaves its rows out by default (flow_grpo drops
    every A = 0 row), `zero_advantage: keep` trains them at half the step; NFT trains them
    (DiffusionNFT filters nothing), so a batch of tied groups still steps."""
    adapter, engine, _, learner = setup
    settings = SamplerSettings(num_steps=4, window_size=1, window_range=(0, 3))
    batch, _ = _fast_batch(adapter, engine, learner, settings, tied_first=True)
    make = lambda algorithm, rule: TrainerConfig(
        algorithm=algorithm, samples_per_prompt=4, sampler=settings,
        advantage={"std": "group", "zero_advantage": rule})
    grpo = UPDATES[Algorithm.FLOW_GRPO]
    dropped, m_drop = _grads_of(grpo, learner, batch, make(Algorithm.FLOW_GRPO, None))
    kept, m_keep = _grads_of(grpo, learner, batch, make(Algorithm.FLOW_GRPO, "keep"))
    assert (m_drop["zero_adv_groups"], m_drop["trained_rows"]) == (1.0, 4.0)
    assert (m_keep["zero_adv_groups"], m_keep["trained_rows"]) == (1.0, 8.0)
    alone, _ = _grads_of(grpo, learner, batch.select(torch.arange(4, 8)),
                         make(Algorithm.FLOW_GRPO, "keep"))
    for d, k, a in zip(dropped, kept, alone):
        torch.testing.assert_close(d, a, rtol=1e-4, atol=1e-9)     # the tied group is gone
        torch.testing.assert_close(k, 0.5 * a, rtol=1e-4, atol=1e-9)  # kept, it halves the step
    tied = batch.select(torch.arange(0, 4))
    grads, m = _grads_of(grpo, learner, tied, make(Algorithm.FLOW_GRPO, None))
    assert grads is None and m["skipped_zero_advantage"] == 1.0
    grads, m = _grads_of(UPDATES[Algorithm.NFT], learner, tied, make(Algorithm.NFT, None))
    assert grads is not None and m["trained_rows"] == 4.0 and m["nft_r_mean"] == 0.5
