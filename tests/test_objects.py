"""ObjectKeeper keeps stage outputs alive at their owner for a bounded time / count."""
import torch

from contract import ArtifactSpec, Layout, MediaArtifact, Modality, Representation
from deployments.objects import HeldRefs, ObjectKeeper


class ManualClock:
    """Seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keeper_holds_refs_then_evicts_by_count_and_age(ray_cluster):
    import ray
    clock = ManualClock()
    keeper = ObjectKeeper(ttl_s=0.5, max_objects=3, clock=clock)
    refs = [keeper.put(torch.full((4,), float(i))) for i in range(5)]
    assert len(keeper) == 3                                  # bounded by count
    assert torch.equal(ray.get(refs[-1]), torch.full((4,), 4.0))
    clock.now += 0.5
    keeper.put(torch.zeros(1))
    assert len(keeper) == 3                                  # exactly ttl old: still held
    clock.now += 0.01
    keeper.put(torch.ones(1))
    assert len(keeper) == 2                                  # older than ttl evicted


def test_held_refs_age_is_read_from_the_clock_only():
    clock = ManualClock()
    held = HeldRefs(ttl_s=10.0, max_objects=100, clock=clock)
    held.add("a", "x", ["ref-a"])
    clock.now += 6.0
    held.add("b", "x", ["ref-b"])
    clock.now += 5.0                                         # a is 11 s old, b 5 s
    held.add("c", "x", ["ref-c"])
    assert len(held) == 2 and held.release(["a"]) == 0 and held.release(["b", "c"]) == 2


def test_put_artifact_handle_describes_the_data(ray_cluster):
    import ray
    spec = ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT, Layout.LATENT_CHW)
    art = MediaArtifact(spec, torch.randn(2, 4, 8, 8))
    handle = ObjectKeeper().put_artifact(art)
    assert handle.shape == (2, 4, 8, 8) and handle.dtype == "float32"
    assert handle.nbytes_hint == 2 * 4 * 8 * 8 * 4
    assert torch.equal(ray.get(handle.ref).data, art.data)
