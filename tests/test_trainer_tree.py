"""Tree / branch GRPO on the engine's branched rollouts, in-process (the real embedded engine
forking rows mid-denoise, the learner; no Ray): the rows' node ids from the engine's RolloutTree,
and one FlowGRPO step whose per-step advantages are the nodes' (BranchGRPO / TreeGRPO) with
shared transitions counted once. The step's gradient is checked against the derivation: at the
sampling policy every ratio is 1, so the clipped surrogate's gradient is that of
-mean_rows(mean_steps(w_bj clip(A_b,j+1) log p_bj)), log p from `recompute_step`."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, InvalidRequestError, LimitExceededError
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest, Fork
from tests.test_trainer_local import _grads_of
from contract import RewardReport, RolloutOutput
from trainer.algorithms import edge_weights, recompute_step, tree_advantages
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.lora import PolicyRole
from trainer.prompts import captions, make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import plan_tree_update, run_update, tree_node_ids

FORKS = (Fork(1, 2), Fork(2, 2))
SETTINGS = SamplerSettings(num_steps=4, window=(0, 3))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(samples_per_prompt=2, prompts_per_step=2, sampler=SETTINGS)
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(6)) * 0.05)
    yield adapter, engine, learner
    asyncio.run(engine.shutdown())


def _branched(adapter, engine, learner, version, forks=FORKS):
    tensors, scale = learner.export()
    engine.load_lora(version, tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 9))
    requests = make_requests(adapter, prompts, SETTINGS, 2, 0, version)

    async def go():
        return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                    ("image_latent",), {}, version, forks))
                for r, p in zip(requests, prompts)]
    return prompts, requests, asyncio.run(go())


def _outputs(requests, results, rewards):
    """One output per request, its rows the tree's leaves (their own seeds)."""
    return [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                          tuple(e.tree.seeds[n] for n in e.tree.leaves),
                          rewards=RewardReport({}, tuple(rw), {}))
            for r, e, rw in zip(requests, results, rewards)]


def _cfg(estimator):
    return TrainerConfig(algorithm=Algorithm.FLOW_GRPO, samples_per_prompt=2, sampler=SETTINGS,
                         flow_grpo={"clip_range": 0.2, "tree_advantage": estimator})


@pytest.mark.parametrize("estimator", ["branch_depthwise", "tree_backprop"])
def test_tree_grpo_step_on_branched_rollouts_is_the_derived_gradient(tiny, estimator):
    adapter, engine, learner = tiny
    prompts, requests, results = _branched(adapter, engine, learner, f"tree-{estimator}")
    leaves = [e.latents["image_latent"].data.shape[0] for e in results]
    assert leaves == [8, 8] and all(e.tree is not None for e in results)
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    outputs = _outputs(requests, results, rewards)
    batch = build_batch(learner, prompts, outputs, [r.sampling for r in requests])
    node_of = tree_node_ids([e.tree for e in results], leaves, 4)
    # shared prefixes: 2 roots per prompt before the first fork, 4 nodes before the second
    assert [int(torch.unique(node_of[:8, d]).numel()) for d in range(5)] == [1, 2, 4, 8, 8]
    cfg = _cfg(estimator)
    plan = plan_tree_update(batch, cfg, torch.Generator().manual_seed(0), node_of)
    # the hand derivation of the same step's gradient
    adv = tree_advantages(node_of, batch.rewards, cfg.flow_grpo.tree_advantage)
    w = edge_weights(node_of)
    traj = batch.trajectory
    total = 0.0
    for j in range(0, 3):
        v = learner.velocity(traj.latents[:, j], traj.sigmas[j].expand(batch.rows), batch.cond,
                             PolicyRole.CURRENT, traj.guidance_scale, None, batch.inputs)
        log_p = recompute_step(traj, j, v).log_prob
        a = w[:, j] * adv[:, j + 1].clamp(-5.0, 5.0)
        total = total + (-(a * log_p)).mean() / 3
    want = torch.autograd.grad(total, learner.params, allow_unused=True)
    want = [torch.zeros_like(p) if g is None else g for p, g in zip(learner.params, want)]
    got, metrics = _grads_of(lambda lr, b, c, g: run_update(lr, plan, c), learner, batch, cfg)
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-5 and metrics["tree_nodes"] == 2 * (2 + 4 + 8)
    assert any(float(g.abs().max()) > 0 for g in want)
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6 * float(h.abs().max()) + 1e-12)
    before = [p.detach().clone() for p in learner.params]
    metrics = run_update(learner, plan, cfg)
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_tree_options_and_bad_branches_are_typed_errors(tiny):
    adapter, engine, learner = tiny
    assert load_trainer_config({"algorithm": "flow_grpo", "flow_grpo": {
        "tree_advantage": "tree_backprop"}}).flow_grpo.tree_advantage.value == "tree_backprop"
    with pytest.raises(Exception) as e:
        load_trainer_config({"flow_grpo": {"tree_advantage": "bushy"}})
    assert "flow_grpo.tree_advantage" in str(e.value)
    for forks, field in [((Fork(5, 2),), "forks[0].step"),        # past the schedule
                         ((Fork(1, 1),), "forks[0].children")]:   # not a branch
        with pytest.raises(InvalidRequestError) as e:
            _branched(adapter, engine, learner, "tree-bad", forks)
        assert e.value.field == field and str(forks[0].step if "step" in field
                                              else forks[0].children) in str(e.value)
    with pytest.raises(LimitExceededError) as e:                 # outgrows one forward
        _branched(adapter, engine, learner, "tree-big", (Fork(1, 64), Fork(2, 64)))
    assert e.value.field.startswith("forks[")
    with pytest.raises(InvalidRequestError) as e:
        prompts, requests, results = _branched(adapter, engine, learner, "tree-shape")
        batch = build_batch(learner, prompts, _outputs(requests, results, [
            [0.0] * 8, [1.0] * 8]), [r.sampling for r in requests])
        plan_tree_update(batch, _cfg("branch_depthwise"), torch.Generator(),
                         torch.zeros(16, 3, dtype=torch.int64))
    assert e.value.field == "node_of"
