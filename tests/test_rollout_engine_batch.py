"""Embedded engine: the persistent batch, admission off the loop, tree / branch rollouts.

In process, on the real tiny_t2i architecture (seeded random DiT weights): the engine's packed
forwards equal a plain loop written here over the same rows bitwise; a request's outputs stay
within 1e-5 across arrival orders and batch compositions; a slow admission never stalls the
requests already running; a forked child equals an independent rollout started from its
parent's latents at the fork step with the child's seed.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import (BranchSpec, Condition, InvalidRequestError, LimitExceededError,
                      RolloutRequest, SamplerKind, SamplingSpec, Task)
from diffusion.noise import initial_noise, row_noise
from diffusion.step import Guidance, predict_velocity, transition
from diffusion.windows import uses_sde
from rollout.config import EngineLimits
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest, Fork, build_tree, child_seed

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def t2i():
    family = TinyT2IFamily()
    model = family.build(seed=0)["transformer"]
    encoders = family.load_encoders()
    prompts = family.conditioner.tokenize(["a red circle at the top", "a blue square",
                                           "a green triangle"])
    conds = [family.conditioner.encode(encoders, [p]) for p in prompts]
    null = family.conditioner.encode(encoders, [family.conditioner.null_prompt()])
    return family, model, prompts, conds, null


def _engine(t2i, max_rows=16) -> EmbeddedEngine:
    family, model, *_ = t2i
    return EmbeddedEngine(family, {"transformer": model}, {}, EngineLimits(max_batch_rows=max_rows))


def _req(t2i, i, seeds, steps=6, window=None, guidance=1.0, sampler=SamplerKind.SDE,
         forks=()) -> EngineRequest:
    _, _, prompts, conds, null = t2i
    sampling = SamplingSpec(sampler=sampler, num_steps=steps, sde_window=window,
                            guidance_scale=guidance, seeds=tuple(seeds))
    rr = RolloutRequest(prompt=prompts[i % 3], sampling=sampling, task=Task.T2I,
                        policy_version="base", request_id=f"req-{i}")
    return EngineRequest(rr, conds[i % 3], null if guidance != 1.0 else None,
                         ("image_latent",), {}, "base", tuple(forks))


def _together(engine, requests):
    """Submitted while paused: all start together and share every forward they can."""
    asyncio.run(engine.sleep())
    futures = [engine.submit(r) for r in requests]
    asyncio.run(engine.wake_up())
    return [f.result(timeout=300) for f in futures]


def _shutdown(engine):
    asyncio.run(engine.shutdown())


def _reference(t2i, requests):
    """A plain loop over the rows of `requests` stacked in one batch: one forward per step,
    each request's own sampler step with its rows' seeded noise. The requests share steps."""
    family, model, *_ = t2i
    first = requests[0].request.sampling
    shape = family.codec.state_shape(first)
    seeds = [r.request.sampling.seeds for r in requests]
    x = torch.cat([initial_noise(s, shape) for s in seeds])
    cond = Condition.cat([r.cond.expand_rows(len(s)) for r, s in zip(requests, seeds)])
    guidance = Guidance.none(x.shape[0])
    sigmas = family.sigmas(first)
    with torch.inference_mode():
        for j in range(first.num_steps):
            sigma = sigmas[j].expand(x.shape[0])
            v = predict_velocity(family.denoiser, {"transformer": model}, x, sigma, cond,
                                 guidance, {})
            out, offset = [], 0
            for r, s in zip(requests, seeds):
                sp = r.request.sampling
                sl = slice(offset, offset + len(s))
                offset += len(s)
                kind = sp.sampler if uses_sde(j, sp.window) else SamplerKind.ODE
                noise = row_noise(s, j, shape) if kind is not SamplerKind.ODE else None
                step = transition(kind, x[sl], v[sl], sigma[sl], sigmas[j + 1].expand(len(s)),
                                  sp.noise_level, noise)
                out.append(step.prev_sample)
            x = torch.cat(out)
    return x


def test_packed_forwards_equal_a_plain_loop_over_the_same_rows_bitwise(t2i):
    """The persistent batch feeds the forward exactly the rows a plain loop stacks: same
    x, sigma and conditions, so the same bits."""
    requests = [_req(t2i, 0, (1, 2), window=(1, 4)), _req(t2i, 1, (3,)),
                _req(t2i, 2, (4, 5, 6), window=(0, 6))]
    engine = _engine(t2i)
    try:
        results = _together(engine, requests)
    finally:
        _shutdown(engine)
    x = _reference(t2i, requests)
    engine_x = torch.cat([r.latents["image_latent"].data for r in results])
    assert torch.equal(engine_x, x)
    assert all(r.metrics["batch_rows_min"] == 6 for r in results)      # one forward per step


def test_the_batch_tensors_persist_across_steps_and_change_only_when_rows_leave(t2i,
                                                                              monkeypatch):
    """Every forward reads the same state tensor while the same rows run (written in place);
    a new one only when a request finishes and its rows leave."""
    import rollout.engine as engine_module
    seen = []
    forward = engine_module.predict_velocity

    def spy(denoiser, models, x, *args, **kwargs):
        seen.append((x.data_ptr(), x.shape[0]))
        return forward(denoiser, models, x, *args, **kwargs)

    monkeypatch.setattr(engine_module, "predict_velocity", spy)
    engine = _engine(t2i)
    try:
        _together(engine, [_req(t2i, 0, (1, 2), steps=6), _req(t2i, 1, (3,), steps=4)])
    finally:
        _shutdown(engine)
    assert [rows for _, rows in seen] == [3] * 4 + [2] * 2
    assert len({ptr for ptr, _ in seen[:4]}) == 1 and len({ptr for ptr, _ in seen[4:]}) == 1


def test_outputs_within_1e5_across_arrival_orders_and_batch_compositions(t2i):
    """Per-row noise and per-row sigma: a request's samples do not depend on which requests
    share its forwards, in which order, or at which of their steps."""
    specs = [dict(i=0, seeds=(1, 2), steps=6, window=(1, 4)), dict(i=1, seeds=(3,), steps=8),
             dict(i=2, seeds=(4, 5, 6), steps=5, guidance=3.0),
             dict(i=3, seeds=(7, 8), steps=7, sampler=SamplerKind.CPS, window=(0, 3)),
             dict(i=4, seeds=(9,), steps=5, sampler=SamplerKind.DPM2)]
    runs = {}
    for name, order, max_rows in (("together", [0, 1, 2, 3, 4], 16),
                                  ("reversed", [4, 3, 2, 1, 0], 16),
                                  ("budget_3", [2, 0, 4, 1, 3], 3)):
        engine = _engine(t2i, max_rows)
        try:
            results = _together(engine, [_req(t2i, **specs[k]) for k in order])
        finally:
            _shutdown(engine)
        runs[name] = {k: r for k, r in zip(order, results)}
    engine = _engine(t2i)
    try:                                   # each alone
        runs["alone"] = {k: _together(engine, [_req(t2i, **specs[k])])[0] for k in range(5)}
    finally:
        _shutdown(engine)
    worst = 0.0
    for name in ("reversed", "budget_3", "alone"):
        for k in range(5):
            a, b = runs["together"][k], runs[name][k]
            for ta, tb in ((a.latents["image_latent"].data, b.latents["image_latent"].data),
                           (a.trajectory.latents, b.trajectory.latents),
                           (a.trajectory.log_probs, b.trajectory.log_probs)):
                if ta.numel():
                    worst = max(worst, float((ta - tb).abs().max()))
    assert runs["budget_3"][2].metrics["batch_rows_max"] <= 3
    print(f"largest difference across arrival orders and compositions: {worst:.3g}")
    assert worst <= 1e-5, worst


def test_different_steps_windows_samplers_and_guidance_scales_share_one_forward(t2i):
    """Mixed work: CFG rows at different guidance scales, step counts, SDE windows and
    sampler kinds run in one forward while all are in flight (the longest alone at its end)."""
    specs = [dict(i=0, seeds=(1,), steps=4, guidance=2.0),
             dict(i=1, seeds=(2, 3), steps=7, window=(2, 5), guidance=4.5),
             dict(i=2, seeds=(4,), steps=5, sampler=SamplerKind.CPS, guidance=3.0),
             dict(i=3, seeds=(5,), steps=6, sampler=SamplerKind.DPM2, guidance=2.5)]
    engine = _engine(t2i)
    try:
        results = _together(engine, [_req(t2i, **s) for s in specs])
    finally:
        _shutdown(engine)
    for spec, res in zip(specs, results):
        assert res.metrics["forwards"] == spec["steps"]
        assert res.metrics["batch_rows_max"] == 5                    # every row of the four
    assert results[1].metrics["batch_rows_min"] == 2                 # alone after the others


def test_a_slow_admission_never_stalls_the_running_requests(t2i):
    """Preparing a request (media encode, sigma table, noise) runs in the admission thread
    outside the engine lock: while one is stuck in it, submit returns and a running request
    steps to its end."""
    engine = _engine(t2i)
    release, entered = threading.Event(), threading.Event()
    prepare = engine._new_state

    def slow_prepare(request, future, enqueued):
        if request.request.request_id == "req-1":
            entered.set()
            release.wait()
        return prepare(request, future, enqueued)

    engine._new_state = slow_prepare
    try:
        running = engine.submit(_req(t2i, 0, (1,), steps=30))
        deadline = time.time() + 120
        while not any(s.step >= 1 for s in list(engine._running)):
            assert time.time() < deadline
            time.sleep(0.005)
        stuck = engine.submit(_req(t2i, 1, (2,)))
        assert entered.wait(timeout=120)
        quick = engine.submit(_req(t2i, 2, (3,)))        # returns: no lock held by admission
        assert running.result(timeout=300).metrics["forwards"] == 30
        assert not stuck.done()                           # still being prepared
        release.set()
        assert stuck.result(timeout=300).latents["image_latent"].data.shape[0] == 1
        assert quick.result(timeout=300).latents["image_latent"].data.shape[0] == 1
    finally:
        release.set()
        _shutdown(engine)


def test_forked_child_equals_an_independent_rollout_from_the_parents_latents(t2i):
    """Fork at step 2 (2 children each), again at step 4 (2 each): every leaf's prefix is its
    unforked parent's bitwise, and from each fork on it equals a plain rollout started from
    the parent's latents at that step with the child's seed."""
    steps, seeds = 7, (5, 6)
    forks = (Fork(2, 2), Fork(4, 2))
    engine = _engine(t2i)
    try:
        parent = _together(engine, [_req(t2i, 0, seeds, steps=steps)])[0]
        forked = _together(engine, [_req(t2i, 0, seeds, steps=steps, forks=forks)])[0]
    finally:
        _shutdown(engine)
    tree = forked.tree
    assert tree == build_tree(seeds, forks)
    assert len(tree.leaves) == 8 and forked.latents["image_latent"].data.shape[0] == 8
    assert tree.parents[:2] == (-1, -1) and tree.starts[2:6] == (2, 2, 2, 2)
    assert tree.seeds[2] == child_seed(5, 2, 0) and tree.seeds[3] == child_seed(5, 2, 1)
    assert forked.trajectory.seeds == tuple(tree.seeds[n] for n in tree.leaves)
    assert forked.metrics["forwards"] == steps
    traj, ref = forked.trajectory, parent.trajectory
    assert traj.latents.shape == (8, steps, 4, 8, 8) and traj.log_probs.shape == (8, steps - 1)
    for leaf in range(8):
        root = tree.ancestor(leaf, 0)
        assert torch.equal(traj.latents[leaf, :3], ref.latents[root, :3])   # x_0 .. x_2
        assert torch.equal(traj.log_probs[leaf, :2], ref.log_probs[root, :2])
    sampling, cond = _req(t2i, 0, seeds, steps=steps).request.sampling, t2i[3][0]
    for leaf in range(8):
        mid = tree.ancestor(leaf, 2)                 # the node that ran steps 2 and 3
        x2 = ref.latents[tree.ancestor(leaf, 0), 2:3]           # its parent's x at step 2
        x4 = _step_to(t2i, sampling, cond, x2, 2, 4, tree.seeds[mid])
        assert (traj.latents[leaf, 4:5] - x4).abs().max() <= 1e-5
        x_end = _step_to(t2i, sampling, cond, traj.latents[leaf, 4:5], 4, steps,
                         tree.seeds[tree.leaves[leaf]])
        assert (forked.latents["image_latent"].data[leaf] - x_end[0]).abs().max() <= 1e-5
    children = forked.latents["image_latent"].data
    assert (children[0] - children[1]).abs().max() > 1e-3           # children really differ


def _step_to(t2i, sampling, cond, x, start, end, seed):
    """A plain loop on one row from x at step `start` to step `end` with `seed`'s noise."""
    family, model = t2i[0], t2i[1]
    shape = family.codec.state_shape(sampling)
    sigmas = family.sigmas(sampling)
    with torch.inference_mode():
        for j in range(start, end):
            sigma = sigmas[j].expand(1)
            v = predict_velocity(family.denoiser, {"transformer": model}, x, sigma, cond,
                                 Guidance.none(1), {})
            kind = sampling.sampler if uses_sde(j, sampling.window) else SamplerKind.ODE
            noise = row_noise((seed,), j, shape) if kind is not SamplerKind.ODE else None
            x = transition(kind, x, v, sigma, sigmas[j + 1].expand(1), sampling.noise_level,
                           noise).prev_sample
    return x


def test_a_fork_re_lays_the_persistent_batch_without_moving_its_neighbours(t2i):
    """A request forking while packed between two others: the others' samples and the forked
    request's leaves stay those of runs without the neighbours (within 1e-5)."""
    forks = (Fork(3, 3),)
    specs = [dict(i=1, seeds=(3,), steps=8), dict(i=0, seeds=(5, 6), steps=6, forks=forks),
             dict(i=2, seeds=(7, 8), steps=5, guidance=1.0)]
    engine = _engine(t2i)
    try:
        packed = _together(engine, [_req(t2i, **s) for s in specs])
        alone = [_together(engine, [_req(t2i, **s)])[0] for s in specs]
    finally:
        _shutdown(engine)
    assert packed[1].metrics["batch_rows_max"] == 1 + 6 + 2          # all in one forward
    assert packed[1].latents["image_latent"].data.shape[0] == 6
    for a, p in zip(alone, packed):
        assert (a.latents["image_latent"].data - p.latents["image_latent"].data).abs().max() \
            <= 1e-5
        assert (a.trajectory.log_probs - p.trajectory.log_probs).abs().max() <= 1e-5


def test_bad_forks_are_refused_before_any_work(t2i):
    engine = _engine(t2i, max_rows=8)
    try:
        with pytest.raises(InvalidRequestError) as err:      # ODE after step 3: same children
            engine.submit(_req(t2i, 0, (1,), steps=6, window=(0, 3), forks=(Fork(4, 2),)))
        assert (err.value.field, err.value.actual) == ("forks[0].step", 4)
        with pytest.raises(InvalidRequestError) as err:
            engine.submit(_req(t2i, 0, (1,), forks=(Fork(3, 2), Fork(2, 2))))
        assert err.value.field == "forks[1].step"
        with pytest.raises(InvalidRequestError) as err:
            engine.submit(_req(t2i, 0, (1,), forks=(Fork(2, 1),)))
        assert err.value.field == "forks[0].children"
        with pytest.raises(LimitExceededError) as err:       # 2 x 3 x 2 = 12 rows > 8
            engine.submit(_req(t2i, 0, (1, 2), forks=(Fork(1, 3), Fork(3, 2))))
        assert (err.value.field, err.value.actual) == ("forks[1].children", 12)
        assert not engine._pending_ids()                      # nothing was queued
    finally:
        _shutdown(engine)


def test_the_strategy_passes_forks_and_returns_the_leaves_with_their_tree(t2i):
    from contract import RequestLimits
    from rollout.config import RolloutConfig
    from rollout.strategy import DiffusionStrategy
    family, _, prompts, conds, _ = t2i
    engine = _engine(t2i)
    strategy = DiffusionStrategy(RolloutConfig(), family, engine, RequestLimits())
    request = RolloutRequest(prompt=prompts[0], task=Task.T2I,
                             sampling=SamplingSpec(num_steps=5, seeds=(4, 5)),
                             branch=BranchSpec(fork_steps=(2,), factor=3))
    try:
        out = asyncio.run(strategy.generate(request, conds[0], None))
    finally:
        _shutdown(engine)
    tree = out.tree
    assert out.artifacts["image_latent"].data.shape[0] == 6 == len(tree.leaves)
    assert out.seeds == out.trajectory.seeds == tuple(tree.seeds[n] for n in tree.leaves)
    assert [tree.parents[n] for n in tree.leaves] == [0, 0, 0, 1, 1, 1]
