"""How stage outputs travel through the graph: small metadata + object references to tensors.

A stage puts each artifact into the object store and returns an `ArtifactHandle` (spec, shape,
dtype, ref). The ingress moves only these handles; tensors go replica -> object store -> replica
and the caller fetches them (the ingress never deserializes a tensor). `ref` is a Ray ObjectRef,
typed Any so the contract does not import Ray.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from contract.artifacts import ArtifactSpec
from contract.enums import StopReason
from contract.errors import InvalidRequestError
from contract.outputs import RewardReport, RolloutTree


@dataclass(frozen=True)
class ArtifactHandle:
    spec: ArtifactSpec
    shape: tuple[int, ...]
    dtype: str
    ref: Any                               # ObjectRef[MediaArtifact]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes_hint(self) -> int:
        itemsize = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize.get(self.dtype, 4)

    def summary(self) -> dict[str, Any]:
        out = {"name": self.spec.name, "modality": self.spec.modality.value,
               "representation": self.spec.representation.value,
               "layout": self.spec.layout.value, "shape": list(self.shape), "dtype": self.dtype}
        out.update({k: v for k, v in self.metadata.items() if k in ("fps", "sample_rate")})
        return out


@dataclass(frozen=True)
class ConditionSignature:
    """What a learner checks an encoded prompt against before it trains on it: the encoders'
    version (`<family>/<dtype>/<weights digest>`, deployments/encoding.encoder_version) and each
    tensor's name, per-row shape and dtype (Condition.batch_key)."""

    encoder_version: str
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]

    @property
    def family(self) -> str:
        return self.encoder_version.split("/", 1)[0]


@dataclass(frozen=True)
class ConditionHandle:
    """An encoded prompt as a named artifact by reference: the encoder stage's own output (one
    row, `contract.Condition`) in the object store, stamped with the encoders' version. The
    trainer's controller passes it on unfetched; the learner that trains the rows fetches it.
    name: "cond" (the prompt) or "uncond" (CFG's unconditional branch: its negative prompt or
    the family's null prompt)."""

    name: str
    encoder_version: str
    ref: Any                               # ObjectRef[Condition]


@dataclass(frozen=True)
class StageOutput:
    """What the rollout and decoder stages return: handles, never tensors."""

    request_id: str
    artifacts: Mapping[str, ArtifactHandle]
    policy_version: str
    seeds: tuple[int, ...]
    stop_reason: StopReason = StopReason.FINISHED
    trajectory: Any = None                 # ObjectRef[Trajectory] or None
    previews: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> data URLs
    metrics: Mapping[str, float] = field(default_factory=dict)
    encoded_token_ids: Mapping[str, tuple[int, ...]] | None = None   # ids the encoder stage saw,
    # per encoder ("negative/<encoder>" for the unconditional prompt under CFG)
    sampling: Any = None                   # the request's SamplingSpec (decoders read sizes)
    tree: RolloutTree | None = None        # a branch rollout's tree (rows = its leaves)


@dataclass(frozen=True)
class GraphResult:
    """The ingress' answer for one request: handles + rewards (+ previews for HTTP)."""

    request_id: str
    artifacts: Mapping[str, ArtifactHandle]
    policy_version: str
    seeds: tuple[int, ...]
    stop_reason: StopReason
    trajectory: Any
    rewards: RewardReport | None
    previews: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    encoded_token_ids: Mapping[str, tuple[int, ...]] | None = None   # per encoder (token check)
    conditions: Mapping[str, ConditionHandle] = field(default_factory=dict)  # the encoder
    # stage's outputs by reference: "cond" and, under CFG, "uncond"
    tree: RolloutTree | None = None        # a branch rollout's tree (rows = its leaves)


PACK_ALIGN = 64     # byte alignment of every tensor inside a PackedTensors buffer


@dataclass(frozen=True)
class PackedTensors:
    """Named CPU tensors in one contiguous byte buffer (how a LoRA version travels).

    One buffer is one object-store copy when published and one zero-copy fetch when loaded,
    instead of a serialisation round per tensor; `unpack` returns views into the buffer.
    entries: (name, dtype name, shape, byte offset) per tensor, offsets PACK_ALIGN-aligned.
    """

    buffer: torch.Tensor                                        # (N,) uint8
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]

    @classmethod
    def pack(cls, tensors: Mapping[str, torch.Tensor]) -> "PackedTensors":
        entries, offset = [], 0
        for name, t in tensors.items():
            if t.device.type != "cpu":
                raise InvalidRequestError("only CPU tensors can be packed",
                                          field=f"tensors[{name}].device", expected="cpu",
                                          actual=str(t.device))
            entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // PACK_ALIGN) * PACK_ALIGN
        buffer = torch.empty(offset, dtype=torch.uint8)
        for (name, _, _, start), t in zip(entries, tensors.values()):
            buffer[start:start + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
        return cls(buffer, tuple(entries))

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def unpack(self) -> dict[str, torch.Tensor]:
        """name -> view into `buffer` (no copy); bounds and dtypes checked."""
        out = {}
        for name, dtype_name, shape, start in self.entries:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidRequestError("unknown dtype in packed tensors",
                                          field=f"tensors[{name}].dtype", actual=dtype_name)
            stop = start + math.prod(shape) * dtype.itemsize
            if start % PACK_ALIGN or stop > self.nbytes:
                raise InvalidRequestError("packed tensor lies outside the buffer",
                                          field=f"tensors[{name}]",
                                          expected=f"aligned range within {self.nbytes} bytes",
                                          actual=(start, stop))
            out[name] = self.buffer[start:stop].view(dtype).view(shape)
        return out
