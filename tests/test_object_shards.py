"""The graph's ObjectHolder scales: HeldRefs releases in O(1) per reference (it touches only the
released requests' entries), and `objects.shards` holder actors split the requests by a digest
of their ids, each shard holding and releasing its own."""
from __future__ import annotations

import asyncio

import pytest

from deployments.config import load_graph_config
from deployments.objects import HeldRefs, HolderShards, HolderSpec, shard_name, shard_of


class CountingId(str):
    """A request id that counts how often a container hashes or compares it."""

    touches = 0

    def __hash__(self) -> int:
        CountingId.touches += 1
        return str.__hash__(self)

    def __eq__(self, other) -> bool:
        CountingId.touches += 1
        return str.__eq__(self, other)


def test_release_touches_only_the_released_requests():
    held = HeldRefs(ttl_s=1e9, max_objects=100_000, clock=lambda: 0.0)
    for i in range(20_000):
        held.add(CountingId(f"r{i}"), "latent", [object()])
    CountingId.touches = 0
    assert held.release(["r123", "r777"]) == 2
    assert CountingId.touches <= 4          # the two released ids' entries, not 20,000 others
    assert len(held) == 19_998


def test_named_release_eviction_and_index_agree():
    now = [0.0]
    held = HeldRefs(ttl_s=10.0, max_objects=4, clock=lambda: now[0])
    held.add("a", "latent", ["a-l"])
    held.add("a", "trajectory", ["a-t"])
    held.add("b", "latent", ["b-l1", "b-l2"])
    assert held.release(["a"], ["latent"]) == 1 and len(held) == 3
    held.add("c", "latent", ["c-l1", "c-l2"])            # over 4: the oldest (a's trajectory)
    assert len(held) == 4 and held.release(["a"]) == 0
    now[0] = 11.0
    held.add("d", "image", ["d-i"])                      # everything older than 10 s goes
    assert len(held) == 1
    assert held.release(["b", "c"]) == 0 and held.release(["d"], ["latent"]) == 0
    assert held.release(["d"]) == 1 and len(held) == 0


def test_shard_of_is_stable_and_spreads():
    ids = [f"req-{i}" for i in range(4000)]
    shards = [shard_of(i, 4) for i in ids]
    assert shards == [shard_of(i, 4) for i in ids] and all(shard_of(i, 1) == 0 for i in ids)
    counts = [shards.count(k) for k in range(4)]
    assert min(counts) > 800                               # ~1000 each
    assert shard_name("g_objects", 0) == "g_objects" and shard_name("g_objects", 2) == \
        "g_objects_2"


def test_shards_and_ttl_are_graph_config_fields():
    config = load_graph_config({"app_name": "g", "objects": {"shards": 3, "ttl_s": 30}})
    assert config.object_holder == HolderSpec("g_objects", 30.0, config.objects.max_objects, 3)
    from contract import ConfigError
    with pytest.raises(ConfigError) as e:
        load_graph_config({"objects": {"shards": 0}})
    assert e.value.field == "objects.shards"


def test_holder_shards_hold_and_release_their_own_requests(ray_cluster):
    import ray

    from deployments.objects import get_object_holder
    spec = HolderSpec("shard_test_objects", ttl_s=600.0, max_objects=300, shards=3)
    shards = HolderShards(spec)
    try:
        refs = {f"req-{i}": ray.put(i) for i in range(30)}

        async def go():
            for rid, ref in refs.items():
                await shards.hold(rid, ["latent"], [ref])
            per_shard = await asyncio.gather(*(a.count.remote() for a in shards.actors))
            bounds = await asyncio.gather(*(a.bounds.remote() for a in shards.actors))
            released = await shards.release(list(refs)[:10])
            return per_shard, bounds, released, await shards.count()
        per_shard, bounds, released, left = asyncio.run(go())
        expected = [sum(shard_of(r, 3) == k for r in refs) for k in range(3)]
        assert list(per_shard) == expected and all(n > 0 for n in expected)
        assert all(b == (600.0, 100) for b in bounds)     # each its share of max_objects
        assert released == 10 and left == 20
        # a second handle (another process's view) finds the same actors by name
        again = HolderShards(spec, create=False)
        assert asyncio.run(again.count()) == 20
    finally:
        for i in range(3):
            ray.kill(get_object_holder(shard_name(spec.name, i), create=False), no_restart=True)
