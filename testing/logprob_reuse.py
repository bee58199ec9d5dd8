"""One FlowGRPO step on real tiny_t2i rollouts, with the old-policy log-probs reused from the
rollout or recomputed: what tests/test_logprob_reuse.py checks and bench/logprob_reuse_bench.py
times."""
from __future__ import annotations

import asyncio
import copy
import time

import torch

from trainer.algorithms import OldLogProbs

VERSION = "t-v0"


def flow_grpo_batch(num_steps: int = 4, window: tuple[int, int] = (0, 2), prompts: int = 2,
                    group: int = 4):
    """(learner, cfg, batch): FlowGRPO rollouts of the tiny_t2i family sampled by the learner's
    own exported adapter (version VERSION) with the embedded engine."""
    from adapters.tiny_t2i import TinyT2IFamily
    from contract import RewardReport, RolloutOutput
    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from trainer.config import PromptSource, SamplerSettings, TrainerConfig
    from trainer.learner import Learner
    from trainer.prompts import captions, make_requests
    from trainer.rollout_batch import build_batch

    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(algorithm="flow_grpo", samples_per_prompt=group,
                        prompts_per_step=prompts,
                        sampler=SamplerSettings(num_steps=num_steps, window=window))
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():   # a nonzero trained adapter: the sampled version is not the base
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    tensors, scale = learner.export()
    engine.load_lora(VERSION, tensors, scale)
    bundles = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, prompts, 0))
    requests = make_requests(adapter, bundles, cfg.sampler, group, 0, VERSION)

    async def go():
        try:
            return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                        ("image_latent",), {}, VERSION))
                    for r, p in zip(requests, bundles)]
        finally:
            await engine.shutdown()
    results = asyncio.run(go())
    # rewards: distance of the sample's mean to a target, a real function of the samples
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    outputs = [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                             r.sampling.seeds, rewards=RewardReport({}, tuple(rw), {}))
               for r, e, rw in zip(requests, results, rewards)]
    return learner, cfg, build_batch(learner, bundles, outputs, [r.sampling for r in requests])


def grpo_step(learner, cfg, batch, mode: OldLogProbs, old_version: str):
    """(gradients, metrics, transformer forwards, seconds) of one FlowGRPO step with the old
    log-probs from `mode`; the learner's weights, gradients and optimizer state are restored."""
    from trainer.updates import plan_update, run_update

    cfg = cfg.model_copy(update={"flow_grpo": cfg.flow_grpo.model_copy(
        update={"old_log_probs": mode})})
    saved = [p.detach().clone() for p in learner.params]
    state = copy.deepcopy(learner.optimizer.state_dict())
    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in learner.models.values()]
    grads: list[torch.Tensor] = []
    step = learner.step

    def keep_grads() -> float:
        grads.extend(p.grad.detach().clone() for p in learner.params)
        return step()
    learner.step = keep_grads
    try:
        t0 = time.perf_counter()
        plan = plan_update(cfg.algorithm, batch, cfg, torch.Generator().manual_seed(0),
                           old_version)
        metrics = run_update(learner, plan, cfg)
        seconds = time.perf_counter() - t0
    finally:
        del learner.step
        for h in hooks:
            h.remove()
        learner.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, s in zip(learner.params, saved):
                p.copy_(s)
        learner.optimizer.load_state_dict(state)
    return grads, metrics, len(calls), seconds
