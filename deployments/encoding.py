"""The text-encoder stage's work, used by the replica (etp 1) and by each ETP shard worker:
load a family's text encoders (inputs placed on their device), name their version (a digest of
their weights) and encode prompts' ids; the replica's prompt-embedding cache."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from adapters.family import ModelFamily
from contract import Condition, PromptBundle
from contract.errors import EncoderVersionError


def load_encoders(family: ModelFamily, device: torch.device | str = "cpu",
                  dtype: str = "float32") -> dict[str, nn.Module]:
    """The family's text encoders only (name -> module), inputs placed on `device`."""
    device = torch.device(device)
    return {name: place_inputs_on(module, device)
            for name, module in family.load_encoders(dtype, device).items()}


def place_inputs_on(encoder: nn.Module, device: torch.device) -> nn.Module:
    """Move the encoder's tensor inputs to `device` (the conditioner pads ids on the CPU)."""
    def hook(module, args, kwargs):
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v   # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    if device.type != "cpu":
        encoder.register_forward_pre_hook(hook, with_kwargs=True)
    return encoder


def encode_prompts(family: ModelFamily, encoders, prompts: Sequence[PromptBundle],
                   media: Sequence[Mapping] | None = None) -> Condition:
    """The conditioner on the ids exactly as given; `token_ids` records, per prompt, the ids of
    every encoder (what the trainer's token check compares). `media`: per prompt, the condition
    media the conditioner reads itself (Conditioner.media_roles)."""
    conditioner = family.conditioner
    cond = (conditioner.encode(encoders, prompts) if media is None
            else conditioner.encode_with_media(encoders, prompts, media)).to("cpu")
    names = family.spec.encoder_names
    return Condition(cond.tensors, tuple(p.ids_by_encoder(names) for p in prompts))


def encoder_version(family: ModelFamily, encoders: Mapping[str, nn.Module], dtype: str) -> str:
    """The version of a family's loaded text encoders: family, dtype and a digest of every
    parameter and buffer (names, shapes, dtypes, bytes; one pass over the weights at load).
    Equal weights give equal versions on any device, process or ETP degree (the shard workers
    digest the full weights before sharding)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(encoders):
        for key, tensor in sorted(encoders[name].state_dict().items()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}.{key}|{flat.dtype}|{tuple(tensor.shape)};".encode())
            digest.update(flat.view(torch.uint8).numpy())
    return f"{family.name}/{dtype}/{digest.hexdigest()}"


PromptKey = tuple   # ((encoder, ids), ..., mask, processor kwargs): what an encoding depends on


def prompt_key(family: ModelFamily, prompt: PromptBundle) -> PromptKey:
    """The cache key of one prompt: its ids per encoder, plus the mask and processor kwargs
    the conditioner also reads (the negative prompt is encoded as a prompt of its own)."""
    ids = prompt.ids_by_encoder(family.spec.encoder_names)
    return (tuple(ids.items()), prompt.attention_mask,
            tuple(sorted((k, repr(v)) for k, v in prompt.processor_kwargs.items())))


@dataclass(frozen=True)
class CachedRow:
    """One prompt's encoding: (1, ...) tensors with storage of their own, and its version."""

    version: str
    tensors: Mapping[str, torch.Tensor]
    nbytes: int


class PromptEmbeddingCache:
    """Encoded prompts by key, least recently used out first, bounded in bytes.

    Every entry carries the encoder version that made it; a lookup for another version is an
    EncoderVersionError naming both (an entry is never served for encoders it did not come
    from). `max_bytes` 0 keeps nothing. Thread-safe (the replica encodes in worker threads)."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.hits = self.misses = self.evictions = self.nbytes = 0
        self._rows: OrderedDict[PromptKey, CachedRow] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: PromptKey, version: str) -> Mapping[str, torch.Tensor] | None:
        with self._lock:
            row = self._rows.get(key)
            if row is not None and row.version != version:
                raise EncoderVersionError("a cached prompt encoding comes from other text "
                                          "encoders", field="encoder_version",
                                          expected=version, actual=row.version)
            if row is None:
                self.misses += 1
                return None
            self.hits += 1
            self._rows.move_to_end(key)
            return row.tensors

    def put(self, key: PromptKey, version: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep one prompt's (1, ...) tensors (cloned: a view would pin its whole batch)."""
        own = {name: t.detach().clone() for name, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in own.values())
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._rows[key] = CachedRow(version, own, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._rows.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "entries": len(self._rows), "bytes": self.nbytes,
                    "max_bytes": self.max_bytes}


async def encode_together(family: ModelFamily, calls: Sequence[Sequence[PromptBundle]],
                          encode) -> list[Condition]:
    """Several calls' prompts in one `await encode(prompts)`: each distinct prompt (by
    `prompt_key`) once, in first-arrival order; per call, its rows in its order with their ids,
    as `encode(call)` alone returns them (a conditioner's rows never depend on their batch
    mates: every family pads each prompt to its own fixed window)."""
    keys = [[prompt_key(family, p) for p in call] for call in calls]
    index: dict[PromptKey, int] = {}
    distinct: list[PromptBundle] = []
    for call, call_keys in zip(calls, keys):
        for prompt, key in zip(call, call_keys):
            if key not in index:
                index[key] = len(distinct)
                distinct.append(prompt)
    fresh: Condition = await encode(distinct)
    return [fresh.index_select([index[k] for k in call_keys]) for call_keys in keys]


async def encode_cached(family: ModelFamily, cache: PromptEmbeddingCache, version: str,
                        prompts: Sequence[PromptBundle], encode) -> Condition:
    """The prompts' Condition with each distinct uncached prompt encoded once: `await
    encode(misses)` runs on the distinct misses only (not at all when every prompt is cached); rows come back
    in the prompts' order with their ids, as `encode_prompts` returns them."""
    keys = [prompt_key(family, p) for p in prompts]
    rows: dict[PromptKey, Mapping[str, torch.Tensor]] = {}
    missing: dict[PromptKey, PromptBundle] = {}
    for key, prompt in zip(keys, prompts):
        if key in rows or key in missing:
            continue
        cached = cache.get(key, version)
        if cached is None:
            missing[key] = prompt
        else:
            rows[key] = cached
    if missing:
        fresh: Condition = await encode(list(missing.values()))
        for i, key in enumerate(missing):
            row = {name: t[i:i + 1] for name, t in fresh.tensors.items()}
            rows[key] = row
            cache.put(key, version, row)
    names = family.spec.encoder_names
    return Condition({name: torch.cat([rows[k][name] for k in keys])
                      for name in rows[keys[0]]},
                     tuple(p.ids_by_encoder(names) for p in prompts))
