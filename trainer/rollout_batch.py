"""The rollouts of one training step as rows: `Batch` (state, rewards, conditions, trajectories,
forward inputs per row) and `build_batch`, which flattens the graph's RolloutOutputs into it.

Conditions: `StageConditions` takes the encoder stage's own outputs by reference (each output's
ConditionHandles, `ConditionRows` in the batch): the controller never fetches them; the learner
that trains a row fetches its request's handle (`fetch_conditions`), checked against the
learner's `ConditionSignature` first. An in-process `Learner` passed instead re-encodes the same
token ids with its own text encoders.
Shapes: B = rows (prompts x group size), *S = sampler state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from adapters.family import MediaCondition, ModelFamily
from contract import (Condition, ConditionHandle, ConditionSignature,
                      InvalidRequestError, MediaRole, PromptBundle, RolloutOutput,
                      RolloutRequest, SamplingSpec, Trajectory, normalize_media)
from contract.errors import EncoderVersionError
from diffusion.step import doubles_rows
from trainer.algorithms.tree import tree_node_ids
from trainer.learner import Learner, encode_media_conditions, request_inputs, state_from_latents


@dataclass(frozen=True)
class ConditionRows:
    """B rows of conditions by reference: the one-row ConditionHandle of each request and,
    per row, which of them it is. Selecting rows moves indices, never tensors."""

    handles: tuple[ConditionHandle, ...]
    row_handle: tuple[int, ...]          # (B,) index into handles

    @property
    def rows(self) -> int:
        return len(self.row_handle)

    def index_select(self, rows: torch.Tensor | Sequence[int]) -> "ConditionRows":
        index = torch.as_tensor(rows, dtype=torch.long).tolist()
        used = sorted({self.row_handle[i] for i in index})
        where = {h: n for n, h in enumerate(used)}
        return ConditionRows(tuple(self.handles[h] for h in used),
                             tuple(where[self.row_handle[i]] for i in index))

    def repeat_rows(self, repeats: Sequence[int]) -> "ConditionRows":
        index = torch.repeat_interleave(torch.arange(self.rows), torch.tensor(list(repeats)))
        return self.index_select(index)

    def fetch(self, signature: ConditionSignature) -> Condition:
        """The rows' tensors from the object store (each request's once), every handle checked
        against `signature` (version before the fetch, names / shapes / dtypes after)."""
        import ray
        for h in self.handles:
            check_handle(h, signature)
        conditions = ray.get([h.ref for h in self.handles])
        for h, c in zip(self.handles, conditions):
            check_condition(h, c, signature)
        return Condition.cat(conditions).index_select(list(self.row_handle))


def check_handle(handle: ConditionHandle, signature: ConditionSignature) -> None:
    if handle.encoder_version != signature.encoder_version:
        raise EncoderVersionError("a condition of other text encoders than the learner's family "
                                  "expects", field=f"conditions.{handle.name}.encoder_version",
                                  expected=signature.encoder_version,
                                  actual=handle.encoder_version)


def check_condition(handle: ConditionHandle, cond: Condition,
                    signature: ConditionSignature) -> None:
    """Names, per-row shapes and dtypes of a fetched condition equal the signature's."""
    if not isinstance(cond, Condition):
        raise InvalidRequestError("a condition handle does not refer to a Condition",
                                  field=f"conditions.{handle.name}", expected="Condition",
                                  actual=type(cond).__name__)
    got = dict((n, (shape, dtype)) for n, shape, dtype in cond.batch_key())
    want = dict((n, (shape, dtype)) for n, shape, dtype in signature.tensors)
    if sorted(got) != sorted(want):
        raise InvalidRequestError("the condition's tensors are not the learner family's",
                                  field=f"conditions.{handle.name}", expected=sorted(want),
                                  actual=sorted(got))
    for name in want:
        if got[name][0] != want[name][0]:
            raise InvalidRequestError("a condition tensor's per-row shape is not the learner "
                                      "family's", field=f"conditions.{handle.name}.{name}.shape",
                                      expected=want[name][0], actual=got[name][0])
        if got[name][1] != want[name][1]:
            raise InvalidRequestError("a condition tensor's dtype is not the learner family's",
                                      field=f"conditions.{handle.name}.{name}.dtype",
                                      expected=want[name][1], actual=got[name][1])


def condition_signature(family: ModelFamily, handle: ConditionHandle,
                        cond: Condition) -> ConditionSignature:
    """What every condition of a run must match: the probe's (one encoding of the encoder stage,
    fetched by a learner) once its version names the learner's family."""
    if handle.encoder_version.split("/", 1)[0] != family.name:
        raise EncoderVersionError("the encoder stage encodes for another model family",
                                  field=f"conditions.{handle.name}.encoder_version",
                                  expected=f"{family.name}/...", actual=handle.encoder_version)
    return ConditionSignature(handle.encoder_version, cond.batch_key())


def fetch_conditions(batch: "Batch | None", signature: ConditionSignature) -> "Batch | None":
    """The batch with its conditions by reference fetched (a learner's shard: its rows only)."""
    if batch is None or not isinstance(batch.cond, ConditionRows):
        return batch
    return dataclasses.replace(
        batch, cond=batch.cond.fetch(signature),
        uncond=None if batch.uncond is None else batch.uncond.fetch(signature))


class StageConditions:
    """Conditions from the encoder stage's outputs by reference (no text encoder here); the
    condition media's entries from the same codec (`media_modules`: the VAE encoder a task with
    condition media needs, else none)."""

    def __init__(self, family: ModelFamily, media_modules=None):
        self.family = family
        self.media_modules = dict(media_modules or {})

    def media_conditions(self, samplings, media) -> list[MediaCondition]:
        return encode_media_conditions(self.family, self.media_modules, samplings, media)

    def forward_inputs(self, samplings, media, repeats, conditions):
        return request_inputs(conditions, repeats)

    def conditions(self, prompts: Sequence[PromptBundle], outputs: Sequence[RolloutOutput],
                   repeats: Sequence[int], guided: bool, media=None
                   ) -> tuple[ConditionRows, ConditionRows | None]:
        names = ("cond", "uncond") if guided else ("cond",)
        for out in outputs:
            for name in names:
                if name not in out.conditions:
                    raise InvalidRequestError("a rollout came back without the encoder stage's "
                                              "condition", field=f"conditions.{name}",
                                              expected=list(names),
                                              actual=sorted(out.conditions),
                                              request_id=out.request_id)
        rows = tuple(i for i, r in enumerate(repeats) for _ in range(r))
        by_name = [ConditionRows(tuple(o.conditions[n] for o in outputs), rows) for n in names]
        return by_name[0], (by_name[1] if guided else None)


@dataclass(frozen=True)
class Batch:
    """Rollouts of one step, flattened to rows."""

    x0: torch.Tensor                   # (B, *S) final clean sampler state
    rewards: torch.Tensor              # (B,) total reward
    group_ids: tuple[str, ...]         # B prompt/request ids
    cond: Condition | ConditionRows    # B rows: each row's condition (by reference until a
    # learner fetches its rows: fetch_conditions)
    trajectory: Trajectory | None      # all rows, when they share one window; else None
    versions: tuple[str, ...]          # B policy versions the rows were sampled with
    scores: dict[str, list[float]]     # '<scorer>/<score>' -> values of OK rows
    sampling: SamplingSpec             # of the first request (all share the settings)
    # per-scorer values that entered the total, (B,) each, NaN where MISSING; and their weights
    reward_values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    reward_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    # rows sharing one SDE window (Flow-GRPO-Fast draws one per prompt group): (rows (R,), the
    # rows' trajectories concatenated); empty for ODE rollouts
    window_groups: tuple[tuple[torch.Tensor, Trajectory], ...] = ()
    uncond: Condition | ConditionRows | None = None   # B rows of CFG's unconditional branch
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the forward's
    # per-request inputs (condition media, position ids), (B, ...) each, as the rollout had them
    seeds: tuple[int, ...] = ()        # B rollout seeds: each row's training draws derive from it
    frozen_mask: torch.Tensor | None = None   # (1, *S) bool: condition entries the rollout held
    # (clean) at every step -- held in the trainer's noised inputs too; None = none
    sigmas: torch.Tensor | None = None  # (N+1,) the rollouts' sigma table (conditions may
    # change it, e.g. LTX-2's keyframe tokens); None = family.sigmas(sampling)
    node_of: torch.Tensor | None = None  # branch rollouts: (B, N+1) int64, the node row b is at
    # after j steps (trainer.algorithms.tree_node_ids of the outputs' trees); None = no output
    # forked (FlowGRPO then trains per-row advantages, a tree batch per-node ones)

    @property
    def rows(self) -> int:
        return int(self.x0.shape[0])

    def select(self, index: torch.Tensor) -> "Batch":
        """The rows `index` (ascending int64), every per-row field with them."""
        position = torch.full((self.rows,), -1, dtype=torch.long)
        position[index] = torch.arange(index.shape[0])
        groups = []
        for rows, traj in self.window_groups:
            keep = position[rows] >= 0
            if keep.any():
                groups.append((position[rows][keep], _traj_rows(traj, keep)))
        groups = tuple(groups)
        whole = groups[0][1] if len(groups) == 1 else None
        return dataclasses.replace(
            self, x0=self.x0[index], rewards=self.rewards[index],
            group_ids=tuple(self.group_ids[i] for i in index.tolist()),
            cond=self.cond.index_select(index), trajectory=whole,
            uncond=None if self.uncond is None else self.uncond.index_select(index),
            inputs={k: v[index] for k, v in self.inputs.items()},
            versions=tuple(self.versions[i] for i in index.tolist()),
            reward_values={k: v[index] for k, v in self.reward_values.items()},
            window_groups=groups, seeds=tuple(self.seeds[i] for i in index.tolist()),
            node_of=None if self.node_of is None else self.node_of[index])


def _traj_rows(traj: Trajectory, keep: torch.Tensor) -> Trajectory:
    return dataclasses.replace(traj, latents=traj.latents[keep], log_probs=traj.log_probs[keep],
                               seeds=tuple(s for s, k in zip(traj.seeds, keep.tolist()) if k))


def _cat_trajectories(trajs: Sequence[Trajectory]) -> Trajectory | None:
    if any(t is None for t in trajs):
        return None
    head = trajs[0]
    for t in trajs[1:]:
        if t.window != head.window or not torch.equal(t.sigmas, head.sigmas):
            raise InvalidRequestError("rollouts of one batch use different windows/schedules",
                                      field="trajectory.window", expected=head.window,
                                      actual=t.window)
    return Trajectory(latents=torch.cat([t.latents for t in trajs]), sigmas=head.sigmas,
                      model_timesteps=head.model_timesteps,
                      log_probs=torch.cat([t.log_probs for t in trajs]), window=head.window,
                      sampler=head.sampler, noise_level=head.noise_level,
                      guidance_scale=head.guidance_scale,
                      seeds=tuple(s for t in trajs for s in t.seeds),
                      policy_version=head.policy_version,
                      frozen_mask=_one_mask([t.frozen_mask for t in trajs]))


def _one_mask(masks: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The condition mask (1, *S) rows of one batch share, or None when none has one."""
    if all(m is None for m in masks):
        return None
    head = masks[0]
    if any(m is None or m.shape[1:] != head.shape[1:] or not bool((m == head[:1]).all())
           for m in masks):
        raise InvalidRequestError("rollouts of one batch hold different condition entries",
                                  field="trajectory.frozen_mask")
    return head[:1]


def _window_groups(trajs: Sequence[Trajectory | None], repeats: Sequence[int]
                   ) -> tuple[tuple[torch.Tensor, Trajectory], ...]:
    """Rows grouped by their SDE window (first-seen order), trajectories concatenated."""
    if any(t is None for t in trajs):
        return ()
    starts = [sum(repeats[:i]) for i in range(len(repeats))]
    by_window: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(trajs):
        by_window.setdefault(tuple(t.window), []).append(i)
    return tuple((torch.cat([torch.arange(starts[i], starts[i] + repeats[i]) for i in members]),
                  _cat_trajectories([trajs[i] for i in members]))
                 for members in by_window.values())


def canonical_media(requests: Sequence[RolloutRequest]) -> list[dict[MediaRole, torch.Tensor]]:
    """Each request's condition media under their canonical roles (as the graph reads them)."""
    return [{role: item.data for role, item in
             normalize_media(r.media, r.task, r.request_id).items()} for r in requests]


def build_batch(learner: Learner | StageConditions, prompts: Sequence[PromptBundle],
                outputs: Sequence[RolloutOutput], samplings: Sequence[SamplingSpec],
                media: Sequence[Mapping[MediaRole, torch.Tensor] | None] | None = None) -> Batch:
    """Flatten RolloutOutputs (one per prompt) into rows; the conditions are the encoder
    stage's by reference (`StageConditions`) or re-encoded by an in-process `Learner` from the
    same PromptBundles that were sent; the per-request forward inputs from the same condition
    media (`media[i]`, canonical roles) and sampling sizes."""
    family = learner.family
    states, rewards, groups, versions = [], [], [], []
    scores: dict[str, list[float]] = {}
    per_scorer: dict[str, list[float]] = {}
    conditions = learner.media_conditions(samplings, media)
    for out, sampling, condition in zip(outputs, samplings, conditions):
        if out.rewards is None:
            raise InvalidRequestError("rollout came back without rewards (no scorer configured)",
                                      field="rewards", request_id=out.request_id)
        latents = {n: a.data for n, a in out.artifacts.items() if a.spec.representation.value
                   == "latent"}
        states.append(family.codec.condition_state(state_from_latents(family, latents, sampling),
                                                   sampling, condition))
        rewards.extend(out.rewards.total)
        groups.extend([out.request_id] * len(out.seeds))
        versions.extend([out.policy_version] * len(out.seeds))
        for name, so in out.rewards.by_scorer.items():
            for key, values in so.scores.items():
                scores.setdefault(f"{name}/{key}", []).extend(v for v in values if v is not None)
        for name, vals in out.rewards.values.items():
            per_scorer.setdefault(name, []).extend(float("nan") if v is None else v for v in vals)
    repeats = [len(o.seeds) for o in outputs]
    # CFG rollouts: each row's unconditional branch too, as the graph formed it
    cond, uncond = learner.conditions(
        prompts, outputs, repeats, doubles_rows(family.spec.guidance, samplings[0].guidance_scale),
        media)
    windows = _window_groups([o.trajectory for o in outputs], repeats)
    weights = dict(outputs[0].rewards.weights)
    sigmas = family.request_sigmas(samplings[0], conditions[0])
    node_of = None
    if any(o.tree is not None for o in outputs):      # a branch rollout: its rows' nodes
        for o in outputs:
            if o.tree is not None and len(o.tree.leaves) != len(o.seeds):
                raise InvalidRequestError("a branch rollout's rows are its tree's leaves",
                                          field="tree.leaves", expected=len(o.seeds),
                                          actual=len(o.tree.leaves), request_id=o.request_id)
        node_of = tree_node_ids([o.tree for o in outputs], repeats,
                                int(windows[0][1].sigmas.shape[0]) - 1 if windows
                                else int(sigmas.shape[0]) - 1)
    return Batch(torch.cat(states), torch.tensor(rewards, dtype=torch.float32), tuple(groups),
                 cond, windows[0][1] if len(windows) == 1 else None, tuple(versions),
                 scores, samplings[0],
                 {k: torch.tensor(v, dtype=torch.float64) for k, v in per_scorer.items()},
                 weights, windows, uncond,
                 learner.forward_inputs(samplings, media, repeats, conditions),
                 tuple(s for o in outputs for s in o.seeds),
                 _one_mask([None if c.frozen is None else c.frozen.mask for c in conditions]),
                 sigmas, node_of)
