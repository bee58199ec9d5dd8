"""contract.PackedTensors: how a LoRA version travels (one buffer, views on load)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from contract import InvalidRequestError, PackedTensors
from contract.transport import PACK_ALIGN


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 5, generator=gen)
    return {"a.lora_A.weight": torch.randn(3, 7, generator=gen),
            "a.lora_B.weight": wide.t(),                               # non-contiguous
            "b.half": torch.randn(5, generator=gen).to(torch.bfloat16),
            "c.ids": torch.arange(11, dtype=torch.int64)}


def test_round_trip_keeps_names_values_dtypes_and_returns_views():
    tensors = _tensors()
    packed = PackedTensors.pack(tensors)
    assert packed.buffer.dtype == torch.uint8 and packed.buffer.ndim == 1
    assert all(start % PACK_ALIGN == 0 for *_, start in packed.entries)
    out = pickle.loads(pickle.dumps(packed)).unpack()        # as it crosses the object store
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    views = packed.unpack()
    base = packed.buffer.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views.values())


def test_bad_entries_fail_closed_naming_the_tensor():
    packed = PackedTensors.pack(_tensors())
    name, dtype, shape, start = packed.entries[0]
    beyond = dataclasses.replace(packed, entries=((name, dtype, (10_000,), start),))
    with pytest.raises(InvalidRequestError) as err:
        beyond.unpack()
    assert err.value.field == f"tensors[{name}]"
    unknown = dataclasses.replace(packed, entries=((name, "float7", shape, start),))
    with pytest.raises(InvalidRequestError) as err:
        unknown.unpack()
    assert err.value.field == f"tensors[{name}].dtype" and err.value.actual == "float7"
    misaligned = dataclasses.replace(packed, entries=((name, dtype, (1,), 4),))
    with pytest.raises(InvalidRequestError):
        misaligned.unpack()
