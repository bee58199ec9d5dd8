"""ObjectKeeper keeps stage outputs alive at their owner for a bounded time / count."""
import time

import torch

from contract import ArtifactSpec, Layout, MediaArtifact, Modality, Representation
from deployments.objects import ObjectKeeper


def test_keeper_holds_refs_then_evicts_by_count_and_age(ray_cluster):
    import ray
    keeper = ObjectKeeper(ttl_s=0.5, max_objects=3)
    refs = [keeper.put(torch.full((4,), float(i))) for i in range(5)]
    assert len(keeper) == 3                                  # bounded by count
    assert torch.equal(ray.get(refs[-1]), torch.full((4,), 4.0))
    time.sleep(0.6)
    keeper.put(torch.zeros(1))
    assert len(keeper) == 1                                  # older than ttl evicted


def test_put_artifact_handle_describes_the_data(ray_cluster):
    import ray
    spec = ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT, Layout.LATENT_CHW)
    art = MediaArtifact(spec, torch.randn(2, 4, 8, 8))
    handle = ObjectKeeper().put_artifact(art)
    assert handle.shape == (2, 4, 8, 8) and handle.dtype == "float32"
    assert handle.nbytes_hint == 2 * 4 * 8 * 8 * 4
    assert torch.equal(ray.get(handle.ref).data, art.data)
