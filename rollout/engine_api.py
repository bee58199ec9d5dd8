"""The boundary between a rollout strategy and a diffusion engine (embedded torch or vLLM-Omni).

Plain dataclasses at the boundary (vLLM v1 style). An engine receives lowered requests whose prompt
is already encoded by the text-encoder stage, runs the sampler, and returns the latent artifacts the
request asked for plus the fp32 trajectory. Decoding is the decoder stage's job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

import torch

from contract import (BranchSpec, Condition, MediaArtifact, MediaRole, RolloutRequest,
                      RolloutTree, StopReason, Trajectory)
from diffusion.noise import NoiseStream, row_seed


@dataclass(frozen=True)
class Fork:
    """At step `step` every row alive splits into `children` rows that share its state x_step
    (and the step's forward); from that step on each child draws its noise from its own seed
    (`child_seed`). The parent row ends there: its path is the children's common prefix."""

    step: int
    children: int


def child_seed(parent_seed: int, step: int, index: int) -> int:
    """The seed of child `index` of a row with seed `parent_seed` forked at `step`: a SplitMix64
    hash of the three, so children of one parent, and of different parents, draw unrelated
    noise streams."""
    return row_seed(row_seed(parent_seed, NoiseStream.STEP, step), NoiseStream.INITIAL, index + 1)


def build_tree(seeds: Sequence[int], forks: Sequence[Fork]) -> RolloutTree:
    """The tree of a request with row seeds `seeds` forked at `forks` (contract.RolloutTree):
    the rows are the roots; at each fork every node alive gets `children` children, parent by
    parent, child i seeded `child_seed(parent's seed, step, i)`."""
    node_seeds, parents, starts = list(seeds), [-1] * len(seeds), [0] * len(seeds)
    alive = list(range(len(seeds)))
    for fork in forks:
        children = []
        for node in alive:
            for i in range(fork.children):
                node_seeds.append(child_seed(node_seeds[node], fork.step, i))
                parents.append(node)
                starts.append(fork.step)
                children.append(len(node_seeds) - 1)
        alive = children
    return RolloutTree(tuple(node_seeds), tuple(parents), tuple(starts), tuple(alive))


def forks_of(branch: BranchSpec | None) -> tuple[Fork, ...]:
    """A request's branch spec as the engine's forks (none for independent rows)."""
    if branch is None:
        return ()
    return tuple(Fork(step, branch.factor) for step in branch.fork_steps)


@dataclass(frozen=True)
class EngineRequest:
    """A validated request with its encoded prompt (rows = samples_per_prompt)."""

    request: RolloutRequest
    cond: Condition                          # one row (the prompt); the engine repeats it per row
    negative: Condition | None               # unconditional branch, exactly when CFG doubles rows
    latent_artifacts: tuple[str, ...]        # latent artifact names to return
    media: Mapping[MediaRole, torch.Tensor]  # canonical condition media (decoded)
    policy_version: str                      # resolved version to sample with
    forks: tuple[Fork, ...] = ()             # tree / branch rollout: forks at increasing steps;
                                             # rows out = samples_per_prompt x prod(children)


@dataclass(frozen=True)
class EngineResult:
    request_id: str
    latents: Mapping[str, MediaArtifact]     # latent artifacts, validated against the IOSpec
    trajectory: Trajectory
    policy_version: str
    stop_reason: StopReason
    metrics: Mapping[str, float]
    tree: RolloutTree | None = None          # the branch structure when the request forked


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
