"""The newer FlowGRPO variants together on the tiny SD3 checkpoint, in-process (the real embedded
engine and learner; no Ray): a MixGRPO-Flash rollout (sliding SDE window, DPM-Solver++(2M) on the
compressed table after it) forked mid-window into branches, trained by one GRPO-Guard step with
TreeGRPO's per-node advantages. The rollout's log-probs equal the learner's at the sampled
version (the branched, compressed trajectory is scored as it was sampled), the guarded ratio is
1 at the old policy and the step moves the adapter. (AWM on this checkpoint:
tests/test_trainer_awm.py.)"""
from __future__ import annotations

import asyncio
import copy

import torch

from adapters.registry import get_family
from contract import Algorithm, RewardReport, RolloutOutput
from diffusion import flash_schedule
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest, Fork
from trainer import checks
from trainer.config import PromptSource, SamplerSettings, TrainerConfig
from trainer.learner import Learner
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import plan_tree_update, run_update, tree_node_ids


def test_flash_branched_guarded_tree_step_on_the_tiny_sd3_checkpoint(tiny_checkpoint):
    torch.set_num_threads(1)
    adapter = get_family("sd3", tiny_checkpoint("sd3"), {"max_sequence_length": 32})
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    settings = SamplerSettings(num_steps=6, flash_compress=0.5, height=16, width=16,
                               sliding_window={"size": 2, "shift_every": 1, "stride": 1})
    cfg = TrainerConfig(algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=2, sampler=settings,
                        steps=2, flow_grpo={"ratio": "grpo_guard", "clip_range": 0.2,
                                            "old_log_probs": "recompute",
                                            "tree_advantage": "tree_backprop"})
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    try:
        with torch.no_grad():
            for p in learner.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
        tensors, scale = learner.export()
        engine.load_lora("sd3-v0", tensors, scale)
        prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 4))
        requests = make_requests(adapter, prompts, settings, 2, 0, "sd3-v0", step=1)
        forks = (Fork(2, 2),)

        async def go():
            return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                        ("image_latent",), {}, "sd3-v0", forks))
                    for r, p in zip(requests, prompts)]
        results = asyncio.run(go())
        rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
                   for e in results]
        outputs = [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                                 tuple(e.tree.seeds[n] for n in e.tree.leaves),
                                 rewards=RewardReport({}, tuple(rw), {}))
                   for r, e, rw in zip(requests, results, rewards)]
        batch = build_batch(learner, prompts, outputs, [r.sampling for r in requests])
        traj = batch.trajectory
        nominal = adapter.sigmas(requests[0].sampling)
        want = flash_schedule(nominal, 3, 0.5, adapter.schedule_shift(requests[0].sampling))
        assert batch.rows == 8 and traj.window == (1, 3)
        assert traj.sigmas.shape == (3 + 2,) and torch.allclose(traj.sigmas, want)
        parity = checks.logprob_mismatch(learner, traj, batch.cond,
                                         {"sd3-v0": tensors}.__getitem__, batch.versions, 1e-4)
        assert parity["logprob_ratio_err_max"] <= 1e-4
        node_of = tree_node_ids([e.tree for e in results], [4, 4], traj.num_steps)
        plan = plan_tree_update(batch, cfg, torch.Generator().manual_seed(0), node_of)
        before = [p.detach().clone() for p in learner.params]
        metrics = run_update(learner, plan, cfg)
        assert abs(metrics["ratio_mean"] - 1.0) < 1e-5 and metrics["grad_norm"] > 0
        assert metrics["trained_window_steps"] == 2.0
        assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
    finally:
        asyncio.run(engine.shutdown())
