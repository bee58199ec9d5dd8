"""The encoder and decoder stages' micro-batches in real Serve replicas (`@serve.batch`): calls
made concurrently share one forward and get what each gets alone; a failing call fails alone.
Integration tier (a Ray cluster); the batch bodies' fast twins are tests/test_stage_microbatch.py.
"""
from __future__ import annotations

import pytest
import torch

from contract import ArtifactHandle, MediaArtifact, SamplingSpec, StageOutput

WAIT_S = 2.0        # long enough that calls sent together on a loaded machine meet in one batch
TEXTS = ["a red circle", "two small blue squares at the bottom right on a white background",
         "a green triangle next to a yellow star"]


def test_encoder_replica_batches_concurrent_calls(ray_cluster, tiny_t2i_weights):
    from ray import serve

    from deployments.encoder import TextEncoderServer
    from deployments.encoding import encode_prompts, load_encoders
    app = serve.deployment(TextEncoderServer, name="TextEncoder",
                           ray_actor_options={"num_cpus": 0.1}).bind(
        "tiny_t2i", tiny_t2i_weights, 1, "cpu", "float32", None, 0, 16, WAIT_S)
    handle = serve.run(app, name="encoder_batch", route_prefix=None)
    try:
        local = TextEncoderServer("tiny_t2i", tiny_t2i_weights)
        family = local.family
        prompts = family.conditioner.tokenize(TEXTS)
        null = family.conditioner.unconditional(prompts[0])
        calls = [[prompts[0]], [null], [prompts[1]], [prompts[2]], [null]]
        responses = [handle.encode.remote(call) for call in calls]     # sent together
        got = [r.result(timeout_s=300) for r in responses]
        stats = handle.cache_stats.remote().result()
        assert stats["forwards"] == 1 and stats["forward_rows"] == 4, stats
        encoders = load_encoders(family)
        for call, cond in zip(calls, got):
            ref = encode_prompts(family, encoders, call)
            assert cond.token_ids == ref.token_ids
            for name, t in ref.tensors.items():
                torch.testing.assert_close(cond[name], t, rtol=1e-5, atol=1e-5)

        # an id past the vocabulary makes the joint forward raise: that call fails alone
        from contract import PromptBundle
        (encoder,) = encoders.values()
        vocab = encoder.get_input_embeddings().num_embeddings
        bad = PromptBundle(token_ids=(prompts[0].token_ids[0], vocab + 5), text="bad ids")
        fresh = family.conditioner.tokenize(["a blue star", "an orange moon"])
        responses = [handle.encode.remote([p]) for p in (fresh[0], bad, fresh[1])]
        with pytest.raises(Exception) as err:
            responses[1].result(timeout_s=300)
        assert "IndexError" in repr(err.value) or "index" in str(err.value).lower()
        for i, prompt in ((0, fresh[0]), (2, fresh[1])):
            cond = responses[i].result(timeout_s=300)
            ref = encode_prompts(family, encoders, [prompt])
            for name, t in ref.tensors.items():
                torch.testing.assert_close(cond[name], t, rtol=1e-5, atol=1e-5)
    finally:
        serve.delete("encoder_batch")


def test_decoder_replica_batches_concurrent_requests(ray_cluster):
    import ray
    from ray import serve

    from deployments.decoder import DecoderServer
    app = serve.deployment(DecoderServer, name="Decoder_image_latent",
                           ray_actor_options={"num_cpus": 0.1}).bind(
        "tiny_t2i", None, "image_latent", 4096, "cpu", "float32", None, None, 8, WAIT_S)
    handle = serve.run(app, name="decoder_batch", route_prefix=None)
    try:
        local = DecoderServer("tiny_t2i", None, "image_latent", 4096)
        spec = local.family.io_spec["image_latent"]
        gen = torch.Generator().manual_seed(0)
        latents = [torch.randn(n, 4, 8, 8, generator=gen) for n in (2, 1, 3)]
        latents[1][0] = 3e38                  # the VAE overflows on it: NaN / Inf out
        outs = []
        for i, x in enumerate(latents):
            art = MediaArtifact(spec, x)
            seeds = tuple(range(10 * i, 10 * i + len(x)))
            outs.append(StageOutput(
                request_id=f"req-{i}", policy_version="base", seeds=seeds,
                artifacts={"image_latent": ArtifactHandle(spec, tuple(x.shape), "float32",
                                                          ray.put(art))},
                sampling=SamplingSpec(num_steps=2, seeds=seeds)))
        responses = [handle.decode.remote(out, ("image",)) for out in outs]   # sent together
        with pytest.raises(Exception) as err:
            responses[1].result(timeout_s=300)
        assert "NonFiniteOutputError" in repr(err.value) and "req-1" in str(err.value)
        stats = handle.batch_stats.remote().result()
        assert stats["forwards"] == 4 and stats["forward_rows"] == 6 + 2 + 1 + 3, stats
        for i in (0, 2):
            out = responses[i].result(timeout_s=300)
            image = ray.get(out.artifacts["image"].ref)
            (ref,) = local._decode(MediaArtifact(spec, latents[i]), list(local.outputs),
                                   f"req-{i}", outs[i].sampling)
            assert torch.equal(image.data, ref.data)
    finally:
        serve.delete("decoder_batch")
