"""How stage outputs travel through the graph: small metadata + object references to tensors.

A stage puts each artifact into the object store and returns an `ArtifactHandle` (spec, shape,
dtype, ref). The ingress moves only these handles; tensors go replica -> object store -> replica
and the caller fetches them (the ingress never deserializes a tensor). `ref` is a Ray ObjectRef,
typed Any so the contract does not import Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from contract.artifacts import ArtifactSpec
from contract.enums import StopReason
from contract.outputs import RewardReport


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
    encoded_token_ids: tuple[int, ...] | None = None   # the ids the encoder stage saw


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
    encoded_token_ids: tuple[int, ...] | None = None   # the ids the encoder saw (token check)
