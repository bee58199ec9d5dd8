"""Groupwise rewards: a scorer that sees every sample of a prompt group at once.

A prompt group is one request's `samples_per_prompt` rows. The scorer stage hands a scorer whole
groups (`ScoreRequest.groups`: the sizes of the consecutive groups of the batch; a micro-batch of
several requests is several groups, never one), and a groupwise scorer refuses a batch whose
groups are not declared, do not cover the batch, or hold fewer than two samples (a group split
across calls cannot be ranked): `GroupSplitError`, naming the field and the sizes.

PickScore_Rank (Flow-Factory, `rewards/pick_score.py::PickScoreRankRewardModel`): each sample's
PickScore, then its rank inside its group as the reward,
    rank_i = #{j in group : s_j < s_i  or (s_j == s_i and j < i)},   reward_i = rank_i / n
i.e. `scores.argsort().argsort() / n` with a stable sort (ties ordered by position), in
{0, 1/n, ..., (n-1)/n}.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from contract import ScorerOutput
from contract.errors import GroupSplitError
from rewards.base import ScoreRequest
from rewards.embedding import ok_output
from rewards.hf_clip import HFClipScorerConfig, PickScoreScorer


@runtime_checkable
class ScoresGroups(Protocol):
    """Marker of a groupwise scorer: `score` reads `ScoreRequest.groups` and each sample's
    value depends on the other samples of its group."""

    groupwise: bool


def is_groupwise(scorer: object) -> bool:
    return bool(getattr(scorer, "groupwise", False))


def group_slices(request: ScoreRequest, batch: int, scorer: str,
                 min_size: int = 2) -> list[slice]:
    """The row slices of the request's groups, checked: declared, covering the batch, each at
    least `min_size` rows."""
    groups = tuple(request.groups)
    if not groups:
        raise GroupSplitError(f"groupwise scorer {scorer!r} needs the request's prompt groups",
                              field=f"{scorer}.groups", expected=f"sizes summing to {batch}",
                              actual=[])
    if sum(groups) != batch:
        raise GroupSplitError(f"groupwise scorer {scorer!r}: the groups do not cover the batch",
                              field=f"{scorer}.groups", expected=f"sizes summing to {batch}",
                              actual=list(groups))
    small = [i for i, n in enumerate(groups) if n < min_size]
    if small:
        raise GroupSplitError(f"groupwise scorer {scorer!r} needs whole prompt groups of at "
                              f"least {min_size} samples (a group split across calls cannot "
                              "be compared within itself)", field=f"{scorer}.groups[{small[0]}]",
                              expected=f">= {min_size}", actual=groups[small[0]])
    out, start = [], 0
    for n in groups:
        out.append(slice(start, start + n))
        start += n
    return out


def rank_in_group(scores: torch.Tensor) -> torch.Tensor:
    """(n,) scores -> (n,) float rank / n, ties in position order (stable sort)."""
    order = torch.argsort(scores, stable=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(scores.numel(), device=scores.device)
    return ranks.float() / scores.numel()


class PickScoreRankScorer:
    """PickScore per sample (rewards.hf_clip), its rank within the group as the reward."""

    kind = "pickscore_rank"
    primary = "rank"
    groupwise = True

    def __init__(self, config: HFClipScorerConfig):
        self.name = config.name or self.kind
        self._pickscore = PickScoreScorer(config.model_copy(update={"name": self.name}))
        self.required_artifacts = self._pickscore.required_artifacts

    def score(self, request: ScoreRequest) -> ScorerOutput:
        slices = group_slices(request, len(request.prompts), self.name)
        picked = self._pickscore.score(request)
        values = torch.tensor(picked.scores["pickscore"], dtype=torch.float64)
        rank = torch.empty_like(values)
        for sl in slices:
            rank[sl] = rank_in_group(values[sl]).double()
        return ok_output(self.name, {"rank": rank, "pickscore": values},
                         dict(picked.metadata, group_sizes=[s.stop - s.start for s in slices]))


def groups_of(requests: Sequence[ScoreRequest]) -> tuple[int, ...]:
    """The groups of requests concatenated in order (each request's own, or its rows as one
    group when it declares none)."""
    return tuple(n for r in requests for n in (r.groups or (len(r.prompts),)))
