"""The encoder stage's prompt-embedding cache (deployments/encoding.py, deployments/encoder.py).

A prompt group's requests (each encodes its prompt and its unconditional prompt, as the ingress
does) and a second epoch over the same prompts run the text encoder once per distinct prompt,
counted by a forward hook on the real encoder; cached rows equal a fresh encoding bit for bit;
an entry of another encoder version is never served; the bytes bound holds.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from contract.errors import EncoderVersionError
from deployments.config import load_graph_config
from deployments.encoder import TextEncoderServer
from deployments.encoding import (PromptEmbeddingCache, encode_prompts, encoder_version,
                                  prompt_key)

TEXTS = ["a red circle on the left", "two small blue squares", "a green triangle"]
GROUP = 4


def _counted(server: TextEncoderServer) -> list[int]:
    """Rows of every forward of the replica's (only) text encoder."""
    rows: list[int] = []
    (encoder,) = server.encoders.values()
    encoder.register_forward_hook(lambda m, args, kwargs, out: rows.append(
        int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    return rows


def test_group_and_second_epoch_encode_once(tiny_t2i_weights):
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights, prompt_cache_bytes=2**20)
    rows = _counted(server)
    family = server.family
    prompts = family.conditioner.tokenize(TEXTS)
    null = family.conditioner.null_prompt()
    fresh = {p.text: encode_prompts(family, server.encoders, [p]) for p in [*prompts, null]}
    rows.clear()

    async def epoch():
        out = []
        for prompt in prompts:                       # a group: GROUP requests of one prompt
            for _ in range(GROUP):
                out.append(await server.encode([prompt]))
                out.append(await server.encode([family.conditioner.unconditional(prompt)]))
        return out

    first, second = asyncio.run(epoch()), asyncio.run(epoch())
    assert sum(rows) == len(TEXTS) + 1              # each prompt and the null prompt once
    stats = asyncio.run(server.cache_stats())
    calls = 2 * 2 * GROUP * len(TEXTS)
    assert stats["misses"] == len(TEXTS) + 1 and stats["hits"] == calls - stats["misses"]
    assert stats["encoder_version"] == encoder_version(family, server.encoders, "float32")
    for out in (first, second):
        for i, prompt in enumerate(prompts):
            for j in range(GROUP):
                for cond, ref in ((out[2 * (i * GROUP + j)], fresh[prompt.text]),
                                  (out[2 * (i * GROUP + j) + 1], fresh[null.text])):
                    assert cond.token_ids == ref.token_ids
                    for name, t in ref.tensors.items():
                        assert torch.equal(cond[name], t), name    # bitwise


def test_batch_with_repeats_encodes_distinct_misses_once(tiny_t2i_weights):
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights, prompt_cache_bytes=2**20)
    rows = _counted(server)
    prompts = server.family.conditioner.tokenize(TEXTS)
    batch = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[1]]
    cond = asyncio.run(server.encode(batch))
    assert rows == [3]                              # one forward, the distinct prompts only
    assert asyncio.run(server.encode(batch[::-1])).rows == 5 and rows == [3]
    for i, p in enumerate(batch):
        ref = encode_prompts(server.family, server.encoders, [p])
        assert torch.allclose(cond["hidden"][i:i + 1], ref["hidden"], atol=1e-5)
        assert cond.token_ids[i] == ref.token_ids[0]


def test_no_cache_encodes_every_call(tiny_t2i_weights):
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights)          # prompt_cache_bytes 0
    rows = _counted(server)
    prompt = server.family.conditioner.tokenize(TEXTS[:1])
    asyncio.run(server.encode(prompt))
    asyncio.run(server.encode(prompt))
    assert rows == [1, 1]


def test_entry_of_another_encoder_version_is_never_served(tiny_t2i_weights):
    server = TextEncoderServer("tiny_t2i", tiny_t2i_weights, prompt_cache_bytes=2**20)
    prompt = server.family.conditioner.tokenize(TEXTS[:1])
    asyncio.run(server.encode(prompt))
    key = prompt_key(server.family, prompt[0])
    with pytest.raises(EncoderVersionError) as e:
        server.cache.get(key, "tiny_t2i/float32/other")
    assert e.value.field == "encoder_version"
    assert e.value.expected == "tiny_t2i/float32/other" and e.value.actual == server.version
    # other weights give another version
    (encoder,) = server.encoders.values()
    with torch.no_grad():
        next(encoder.parameters()).add_(1e-3)
    assert encoder_version(server.family, server.encoders, "float32") != server.version


def test_bytes_bound_evicts_least_recently_used():
    row = {"hidden": torch.zeros(1, 16, 8)}                  # 512 bytes
    cache = PromptEmbeddingCache(max_bytes=1200)
    for k in ("a", "b"):
        cache.put((k,), "v", row)
    assert cache.get(("a",), "v") is not None               # a is now the most recent
    cache.put(("c",), "v", row)                             # over 1200: b goes
    assert cache.get(("b",), "v") is None and cache.get(("a",), "v") is not None
    assert cache.stats()["bytes"] == 1024 and cache.stats()["evictions"] == 1
    cache.put(("big",), "v", {"hidden": torch.zeros(1, 64, 8)})   # larger than the bound
    assert cache.get(("big",), "v") is None
    with pytest.raises(ValueError):
        PromptEmbeddingCache(-1)


def test_cache_bound_is_a_graph_config_field():
    config = load_graph_config({"encoder": {"prompt_cache_mib": 64, "memory_mib": 1024}})
    assert config.encoder.prompt_cache_bytes == 64 * 2**20
    from contract import ConfigError
    with pytest.raises(ConfigError) as e:
        load_graph_config({"encoder": {"prompt_cache_mib": 2048, "memory_mib": 1024}})
    assert e.value.field.startswith("encoder")
