"""What comes back: trajectories, scores, rollout outputs and AR token outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from contract.artifacts import MediaArtifact
from contract.enums import SamplerKind, ScoreStatus, StopReason


@dataclass(frozen=True)
class Trajectory:
    """The sampler's record for B rows of one request, in the project's sigma convention.

    latents:          (B, W+1, *S) fp32 -- sampler state x before each window step and after the last
    sigmas:           (N+1,) fp32       -- the full schedule, sigma_0 = 1 ... sigma_N = 0
    model_timesteps:  (N,) fp32         -- the time value actually fed to the model at each step
    log_probs:        (B, W) fp32       -- element-mean log-density of each window transition
    window:           (start, end)      -- steps [start, end) used the stochastic sampler
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    model_timesteps: torch.Tensor
    log_probs: torch.Tensor
    window: tuple[int, int]
    sampler: SamplerKind
    noise_level: float
    guidance_scale: float
    seeds: tuple[int, ...]
    policy_version: str
    frozen_mask: torch.Tensor | None = None   # (1 or B, *S) bool: condition entries held fixed,
                                              # not scored by the log-probs; None = none

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1


@dataclass(frozen=True)
class RolloutTree:
    """The branch structure of a branch rollout (RolloutRequest.branch). Nodes in creation
    order: the request's rows (roots, start 0, parent -1), then each fork's children, parent by
    parent. Output row r is the leaf `leaves[r]`; its trajectory is its whole root-to-leaf path
    (the prefix before a node's start step is its parent's, bitwise). Built by the rollout
    engine (rollout.engine_api.build_tree), carried unchanged to the trainer and over HTTP."""

    seeds: tuple[int, ...]         # per node: the seed of its noise from its start step on
    parents: tuple[int, ...]       # per node: the parent node, -1 for a root
    starts: tuple[int, ...]        # per node: the step it forked at (0 for a root)
    leaves: tuple[int, ...]        # per output row: its node

    def alive_at(self, step: int) -> tuple[int, ...]:
        """The nodes whose rows run step `step`, in row order."""
        out = []
        for leaf in self.leaves:
            node = leaf
            while self.starts[node] > step:
                node = self.parents[node]
            if not out or out[-1] != node:
                out.append(node)
        return tuple(out)

    def ancestor(self, leaf_row: int, step: int) -> int:
        """The node output row `leaf_row` ran step `step` as (per-node advantages group leaves
        by it)."""
        node = self.leaves[leaf_row]
        while self.starts[node] > step:
            node = self.parents[node]
        return node

    def as_json(self) -> dict[str, list[int]]:
        """The tree as the HTTP response carries it (seeds are 64-bit: JSON integers)."""
        return {"seeds": list(self.seeds), "parents": list(self.parents),
                "starts": list(self.starts), "leaves": list(self.leaves)}


@dataclass(frozen=True)
class ScorerOutput:
    """Named scores of one scorer for B samples, with a status (and reason) per sample.

    A score is None exactly where its sample's status is not OK: never a substituted 0.
    metadata: JSON-safe facts on how the batch was scored, the same for every sample (e.g. the
    frame indices sampled from a video).
    """

    scorer: str
    scores: Mapping[str, tuple[float | None, ...]]
    status: tuple[ScoreStatus, ...]
    reasons: tuple[str | None, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.status)


@dataclass(frozen=True)
class RewardReport:
    """Per-scorer outputs and the weighted total per sample (weights renormalised per sample).

    values: scorer -> the per-sample value that entered the total (its chosen named score after
    the configured normalisation), None where that scorer is MISSING for the sample.
    """

    by_scorer: Mapping[str, ScorerOutput]
    total: tuple[float, ...]
    weights: Mapping[str, float]
    values: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutOutput:
    request_id: str
    artifacts: Mapping[str, MediaArtifact]
    trajectory: Trajectory | None
    policy_version: str
    seeds: tuple[int, ...]
    stop_reason: StopReason = StopReason.FINISHED
    rewards: RewardReport | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    conditions: Mapping[str, Any] = field(default_factory=dict)   # name -> ConditionHandle
    # (contract.transport): the encoder stage's outputs, never fetched by the caller
    tree: RolloutTree | None = None   # a branch rollout's tree: its rows are the tree's leaves
    # (`seeds` the leaves' own seeds); None = independent rows
