"""State that outlives a request is bounded and never pinned by a failure, in process: the policy
store's versions per trainer run (latest by step), the rollout replica's per-version locks, and
the object holder's TTL taken from GraphConfig and checked against the trainer's step time."""
from __future__ import annotations

import asyncio

import pytest

from contract import ConfigError
from deployments.config import GraphConfig
from deployments.objects import ObjectHolder
from deployments.policy_store import PolicyVersions, PublishedPolicy
from deployments.rollout import KeyedLocks


def _policy(version: str, step: int) -> PublishedPolicy:
    return PublishedPolicy(version, step, 1.0, [f"ref-of-{version}"])


def test_two_runs_on_one_store_keep_their_own_versions():
    """Each run keeps its own newest `keep`: a second trainer publishing many versions never
    evicts the first one's (before: one keep-8 list shared by every publisher)."""
    store = PolicyVersions(keep=3, max_runs=4)
    for step in range(3):
        assert store.add(_policy(f"runA/v{step}", step)) == []
    dropped = []
    for step in range(10):
        dropped += store.add(_policy(f"runB/v{step}", step))
    assert store.versions("runA") == ["runA/v0", "runA/v1", "runA/v2"]
    assert store.versions("runB") == ["runB/v7", "runB/v8", "runB/v9"]
    assert dropped == [f"runB/v{s}" for s in range(7)]
    assert store.get("runA/v0").tensors == ["ref-of-runA/v0"]
    assert store.latest("runA") == "runA/v2" and store.latest() == "runB/v9"


def test_latest_is_by_step_not_arrival():
    """A restore re-registers a run's older versions after its newer ones arrived: the latest
    is still the highest step, and eviction drops the lowest steps."""
    store = PolicyVersions(keep=3)
    store.add(_policy("run/v5", 5))
    for step in (2, 3, 4):                      # arrive later, older steps
        store.add(_policy(f"run/v{step}", step), active=False)
    assert store.latest("run") == store.latest() == "run/v5"
    assert store.versions("run") == ["run/v3", "run/v4", "run/v5"]
    assert "run/v2" not in store


def test_runs_are_bounded_and_the_least_recent_goes():
    store = PolicyVersions(keep=2, max_runs=2)
    store.add(_policy("a/v0", 0))
    store.add(_policy("b/v0", 0))
    store.add(_policy("a/v1", 1))               # a published last: b is the least recent
    assert store.add(_policy("c/v0", 0)) == ["b/v0"]
    assert store.versions() == ["a/v0", "a/v1", "c/v0"]
    assert store.latest() == "c/v0"


def test_keyed_locks_leave_nothing_behind_per_distinct_key():
    """Every distinct policy_version string used to leave an asyncio.Lock behind in the rollout
    replica; an entry now lives only while a call holds or waits for it."""
    async def main():
        locks = KeyedLocks()
        for i in range(1000):
            try:
                async with locks.hold(f"client-version-{i}"):
                    if i % 2:
                        raise LookupError("unknown policy version")
            except LookupError:
                pass
        assert len(locks) == 0
        # mutual exclusion per key while held: the second waits for the first
        order: list[str] = []
        release = asyncio.Event()

        async def first():
            async with locks.hold("v"):
                order.append("first in")
                await release.wait()
                order.append("first out")

        async def second():
            async with locks.hold("v"):
                order.append("second in")
        a = asyncio.create_task(first())
        await asyncio.sleep(0)
        b = asyncio.create_task(second())
        await asyncio.sleep(0)
        assert order == ["first in"] and len(locks) == 1
        release.set()
        await asyncio.gather(a, b)
        assert order == ["first in", "first out", "second in"] and len(locks) == 0
    asyncio.run(main())


def test_holder_ttl_comes_from_graph_config():
    """The holder's bounds are GraphConfig.objects (before: a hard-coded 600 s): an output no
    caller releases is dropped after the configured TTL, not before."""
    config = GraphConfig(objects={"ttl_s": 30.0, "max_objects": 100})
    spec = config.object_holder
    assert (spec.ttl_s, spec.max_objects) == (30.0, 100)
    assert GraphConfig().object_holder.ttl_s == 600.0
    now = [0.0]
    holder = ObjectHolder(spec.ttl_s, spec.max_objects, clock=lambda: now[0])
    holder.hold("r1", ["image"], ["ref-1"])
    now[0] = 30.0
    assert holder.hold("r2", ["image"], ["ref-2"]) == 2          # exactly ttl old: kept
    now[0] = 30.5
    assert holder.hold("r3", ["image"], ["ref-3"]) == 2          # r1 older than ttl: dropped
    holder.configure(10.0, 100)                                 # a redeployed graph's bounds
    now[0] = 41.0
    assert holder.hold("r4", ["image"], ["ref-4"]) == 1
    assert holder.bounds() == (10.0, 100)


def test_trainer_refuses_a_holder_ttl_shorter_than_its_steps():
    """Checked at start-up, before any weight loads: a TTL under HOLD_MARGIN x the steps a
    batch's outputs wait would drop outputs the trainer has still to fetch."""
    from trainer.config import HOLD_MARGIN, TrainerConfig, check_holder_ttl
    from trainer.loop import Trainer
    graph = GraphConfig(objects={"ttl_s": 300.0})
    cfg = TrainerConfig(graph=graph, pipeline={"mode": "async", "max_staleness": 1,
                                               "expected_step_s": 100.0})
    with pytest.raises(ConfigError) as err:
        check_holder_ttl(cfg, graph)
    assert err.value.field == "graph.objects.ttl_s" and err.value.actual == 300.0
    assert err.value.expected == f">= {HOLD_MARGIN * 2 * 100.0}"
    with pytest.raises(ConfigError):
        Trainer(cfg)                       # before the learner loads or a graph is reached
    check_holder_ttl(cfg.model_copy(update={"graph": GraphConfig(objects={"ttl_s": 400.0})}),
                     GraphConfig(objects={"ttl_s": 400.0}))
    default = TrainerConfig(graph=GraphConfig())
    check_holder_ttl(default, default.graph_config())        # the defaults agree


def test_trainer_sampler_noise_level_below_the_kinds_minimum_is_a_config_error():
    """The trainer's sampler settings are refused at load, naming the field, instead of every
    rollout request failing its SamplingSpec later."""
    from trainer.config import load_trainer_config
    with pytest.raises(ConfigError) as err:
        load_trainer_config({"graph": GraphConfig(), "sampler": {"noise_level": 1e-40}})
    assert "sampler" in err.value.field and "minimum" in err.value.message
