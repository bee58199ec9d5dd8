"""The boundary between a rollout strategy and a diffusion engine (embedded torch or vLLM-Omni).

Plain dataclasses at the boundary (vLLM v1 style). An engine receives lowered requests whose prompt
is already encoded by the text-encoder stage, runs the sampler, and returns the latent artifacts the
request asked for plus the fp32 trajectory. Decoding is the decoder stage's job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import torch

from contract import Condition, MediaArtifact, MediaRole, RolloutRequest, StopReason, Trajectory


@dataclass(frozen=True)
class EngineRequest:
    """A validated request with its encoded prompt (rows = samples_per_prompt)."""

    request: RolloutRequest
    cond: Condition                          # one row (the prompt); the engine repeats it per row
    negative: Condition | None               # unconditional branch, exactly when CFG doubles rows
    latent_artifacts: tuple[str, ...]        # latent artifact names to return
    media: Mapping[MediaRole, torch.Tensor]  # canonical condition media (decoded)
    policy_version: str                      # resolved version to sample with


@dataclass(frozen=True)
class EngineResult:
    request_id: str
    latents: Mapping[str, MediaArtifact]     # latent artifacts, validated against the IOSpec
    trajectory: Trajectory
    policy_version: str
    stop_reason: StopReason
    metrics: Mapping[str, float]


@runtime_checkable
class DiffusionEngine(Protocol):
    """What DiffusionStrategy drives. One engine loop per replica."""

    async def generate(self, request: EngineRequest) -> EngineResult: ...

    def cancel(self, request_id: str) -> bool: ...

    def load_lora(self, version: str, tensors: Mapping[str, torch.Tensor],
                  scale: float = 1.0, copy: bool = True) -> None:
        """Load peft-format LoRA tensors (training-side names) as `version`. Typed error on a
        zero-match / unknown-target / shape mismatch. copy=False: the caller hands the tensors
        over (never writes them again), so the engine may keep views instead of copies."""
        ...

    def unload_lora(self, version: str) -> None: ...

    def versions(self) -> tuple[str, ...]: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...

    async def shutdown(self) -> None: ...
