"""Micro-batching of concurrent calls in the encoder and decoder stages (deployments/microbatch.py,
deployments/encoder.py, deployments/decoder.py), in-process: the stages' own batch bodies (what
`@serve.batch` calls with the concurrent calls of a replica) against each call run alone.

Batched outputs equal one-at-a-time outputs within fp32 tolerance (prompts of different lengths:
each family's tokenizer padding and masks), each distinct prompt is encoded once per batch, and a
call that fails (a typed error) fails alone while the others get their own outputs.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from contract import MediaArtifact, NonFiniteOutputError, SamplingSpec
from deployments.microbatch import groups_by_key, run_isolated

TEXTS = ["a red circle", "two small blue squares at the bottom right on a white background",
         "a green triangle next to a yellow star"]


def test_run_isolated_groups_by_key_and_isolates_a_failing_item():
    """Equal keys share a run; a joint run that raises is redone item by item."""
    runs: list[list[int]] = []

    async def run(group):
        runs.append(list(group))
        if 13 in group:
            raise ValueError("thirteen")
        return [x * 10 for x in group]

    out = asyncio.run(run_isolated([1, 2, 13, 4, 5], lambda x: x % 2, run))
    assert groups_by_key([1, 2, 13, 4, 5], lambda x: x % 2) == [[0, 2, 4], [1, 3]]
    assert out[:2] == [10, 20] and out[3:] == [40, 50]
    assert isinstance(out[2], ValueError) and str(out[2]) == "thirteen"
    assert runs == [[1, 13, 5], [1], [13], [5], [2, 4]]


# ---- encoder -----------------------------------------------------------------------------


def _calls(family):
    """Three requests' prompts and negatives as the ingress sends them (one call each), one
    prompt twice."""
    prompts = family.conditioner.tokenize(TEXTS)
    null = family.conditioner.unconditional(prompts[0])
    return [[prompts[0]], [null], [prompts[1]], [null], [prompts[2], prompts[0]]]


def _check_batched_equals_single(server):
    from deployments.encoding import encode_prompts
    calls = _calls(server.family)
    single = [encode_prompts(server.family, server.encoders, call) for call in calls]
    batched = asyncio.run(server._encode_calls(calls))
    assert server.forwards == 1 and server.forward_rows == 4   # 3 prompts + null, once each
    for one, both in zip(single, batched):
        assert both.token_ids == one.token_ids
        assert set(both.tensors) == set(one.tensors)
        for name, t in one.tensors.items():
            assert both[name].shape == t.shape and both[name].dtype == t.dtype, name
            torch.testing.assert_close(both[name], t, rtol=1e-5, atol=1e-5, msg=name)
    return batched


def test_encoder_batch_equals_one_at_a_time_tiny_t2i(tiny_t2i_weights):
    from deployments.encoder import TextEncoderServer
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights)
    batched = _check_batched_equals_single(server)
    # prompts of different lengths: each row padded to the family's window, pads zeroed
    ids = [len(p.token_ids) for call in _calls(server.family) for p in call]
    assert len(set(ids)) > 1


def test_encoder_batch_equals_one_at_a_time_qwen_image(tiny_checkpoint):
    """Qwen2.5-VL with its chat template, attention mask and per-prompt mask out."""
    from deployments.encoder import TextEncoderServer
    server = TextEncoderServer("qwen_image", str(tiny_checkpoint("qwen_image")))
    batched = _check_batched_equals_single(server)
    masks = [b["prompt_mask"] for b in batched]
    assert len({int(m.sum()) for m in masks}) > 1       # different valid lengths per prompt


def test_encoder_batch_fails_only_the_failing_call(tiny_t2i_weights):
    """One call's prompt makes the forward raise (an id the embedding does not have, sent past
    the ingress's check): the joint forward is redone call by call, the others get exactly
    their single encodings. A prompt whose encoding is NaN (a poisoned embedding row) fails its
    own call with a typed NonFiniteOutputError and no other."""
    from contract import PromptBundle
    from deployments.encoder import TextEncoderServer
    from deployments.encoding import encode_prompts
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights)
    family = server.family
    good = family.conditioner.tokenize(TEXTS)
    (encoder,) = server.encoders.values()
    vocab = encoder.get_input_embeddings().num_embeddings
    bad = PromptBundle(token_ids=(good[0].token_ids[0], vocab + 5), text="out of vocabulary")
    out = asyncio.run(server._encode_calls([[good[0]], [bad], [good[1]]]))
    assert isinstance(out[1], IndexError)
    for i, prompt in ((0, good[0]), (2, good[1])):
        ref = encode_prompts(family, server.encoders, [prompt])
        for name, t in ref.tensors.items():
            assert torch.equal(out[i][name], t), name        # run alone: the same forward

    poison = next(t for t in good[2].token_ids      # a token only the third prompt has
                  if all(t not in p.token_ids for p in good[:2]))
    with torch.no_grad():
        encoder.get_input_embeddings().weight[poison] = float("nan")
    out = asyncio.run(server._encode_calls([[good[0]], [good[2]], [good[1]]]))
    assert isinstance(out[1], NonFiniteOutputError) and out[1].http_status == 500
    assert out[1].field.startswith("condition.") and out[1].actual == "rows [0]"
    for i, prompt in ((0, good[0]), (2, good[1])):
        ref = encode_prompts(family, server.encoders, [prompt])
        for name, t in ref.tensors.items():
            torch.testing.assert_close(out[i][name], t, rtol=1e-5, atol=1e-5)


# ---- decoders ----------------------------------------------------------------------------
def _decode_call(decoder, latent: torch.Tensor, request_id: str, seeds, **size):
    from deployments.decoder import _DecodeCall
    spec = decoder.family.io_spec[decoder.latent_name]
    return _DecodeCall(MediaArtifact(spec, latent), decoder.outputs, request_id,
                       SamplingSpec(num_steps=2, seeds=tuple(seeds), **size))


@pytest.mark.parametrize("family,latent_name,size", [
    ("tiny_t2i", "image_latent", {}),
    ("tiny_t2va", "video_latent", {"num_frames": 8}),
    ("tiny_t2va", "audio_latent", {"num_frames": 8})])
def test_decoder_batch_equals_one_at_a_time(family, latent_name, size):
    """Three requests (1, 3 and 2 rows) decoded in one forward: each gets its own rows, equal
    to decoding it alone (uint8 pixels: at most 1 level; audio within fp32 tolerance), with
    storage of its own."""
    from deployments.decoder import DecoderServer
    decoder = DecoderServer(family, None, latent_name, 4096)
    sampling = SamplingSpec(num_steps=2, seeds=(0,), **size)
    shape = decoder.family.codec.split_state(torch.zeros(
        1, *decoder.family.codec.state_shape(sampling)), sampling)[latent_name].shape[1:]
    gen = torch.Generator().manual_seed(0)
    latents = [torch.randn(n, *shape, generator=gen) for n in (1, 3, 2)]
    calls = [_decode_call(decoder, x, f"req-{i}", range(10 * i, 10 * i + len(x)), **size)
             for i, x in enumerate(latents)]
    rows: list[int] = []
    for module in decoder.modules.values():
        for child in module.children():
            child.register_forward_pre_hook(lambda m, args: rows.extend(
                int(a.shape[0]) for a in args[:1] if isinstance(a, torch.Tensor)))
    batched = asyncio.run(decoder._decode_calls(calls))
    joint = list(rows)
    rows.clear()
    decoder._decode(calls[0].latent, list(decoder.outputs), "req-0", calls[0].sampling)
    # as many component forwards as one request alone (of 1 row), each with 6x the rows
    assert joint and len(joint) == len(rows) and joint == [6 * r for r in rows]
    for call, x, (produced, seconds) in zip(calls, latents, batched):
        alone = decoder._decode(MediaArtifact(call.latent.spec, x), list(decoder.outputs),
                                call.request_id, call.sampling)
        assert seconds > 0 and [a.name for a in produced] == [a.name for a in alone]
        for got, ref in zip(produced, alone):
            assert got.data.shape == ref.data.shape and got.data.dtype == ref.data.dtype
            assert got.data.untyped_storage().nbytes() == got.data.nbytes   # not a view
            if ref.data.dtype == torch.uint8:
                assert (got.data.int() - ref.data.int()).abs().max() <= 1
            else:
                torch.testing.assert_close(got.data, ref.data, rtol=1e-5, atol=1e-5)


def test_decoder_batch_fails_only_the_request_with_non_finite_media():
    """A finite latent the VAE overflows on (the middle request's) makes the joint decode raise:
    it is redone request by request, the middle request gets its typed NonFiniteOutputError
    naming its own id, the others their images as decoded alone. Different sizes never share
    a forward."""
    from deployments.decoder import DecoderServer
    decoder = DecoderServer("tiny_t2i", None, "image_latent", 4096)
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(2, 4, 8, 8, generator=gen) for _ in range(3)]
    latents[1][0] = 3e38
    calls = [_decode_call(decoder, x, f"req-{i}", (2 * i, 2 * i + 1))
             for i, x in enumerate(latents)]
    out = asyncio.run(decoder._decode_calls(calls))
    assert isinstance(out[1], NonFiniteOutputError) and out[1].request_id == "req-1"
    assert out[1].field.startswith("decoded.vae") and out[1].actual == "rows [0]"
    for i in (0, 2):
        (image,), _ = out[i]
        (ref,) = decoder._decode(MediaArtifact(calls[i].latent.spec, latents[i]),
                                 list(decoder.outputs), f"req-{i}", calls[i].sampling)
        assert torch.equal(image.data, ref.data)
    big = _decode_call(decoder, torch.randn(1, 4, 16, 16, generator=gen), "req-big", (9,),
                       height=64, width=64)
    assert len({c.key() for c in (calls[0], big)}) == 2
