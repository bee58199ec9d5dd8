"""Group-relative advantages, the DiffusionNFT optimality probability, and DPO pair selection.

References: FlowGRPO (arXiv 2505.05470, group-relative advantage A_i = (R_i - mean) / std),
DiffusionNFT (arXiv 2509.16117, optimality r = 1/2 + 1/2 clip((R - E[R|c]) / Z_c, -1, 1)),
Diffusion-DPO (arXiv 2311.12908) on (best, worst) pairs per prompt (Flow-DPO, arXiv 2501.13918).
Shapes: B = samples in the batch; groups are the samples of one prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Hashable, Mapping, Sequence

import torch

from contract import Algorithm, ConfigError, InvalidRequestError, NonFiniteError


class AdvantageMode(str, Enum):
    """How NFT turns an advantage into the optimality probability r (before the /c mapping)."""

    CONTINUOUS = "continuous"        # A clipped to [-c, c]
    POSITIVE_ONLY = "positive_only"  # A clipped to [0, c]   -> r >= 1/2
    NEGATIVE_ONLY = "negative_only"  # A clipped to [-c, 0]  -> r <= 1/2
    ONE_ONLY = "one_only"            # A := 1 if A > 0 else 0 -> r in {1/2, 1/2 + 1/(2c)}
    BINARY = "binary"                # A := sign(A)  -> r in {1/2 - 1/(2c), 1/2, 1/2 + 1/(2c)}


def _check_rewards(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> None:
    if rewards.ndim != 1:
        raise InvalidRequestError("rewards must be 1-D (one scalar per sample)", field="rewards",
                                  expected="shape (B,)", actual=tuple(rewards.shape))
    if len(group_ids) != rewards.shape[0]:
        raise InvalidRequestError("one group id per reward", field="group_ids",
                                  expected=rewards.shape[0], actual=len(group_ids))
    if not torch.isfinite(rewards).all():
        raise NonFiniteError("rewards hold NaN/Inf", field="rewards",
                             actual=rewards[~torch.isfinite(rewards)].tolist())


def group_index(group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Dense group index per sample in first-seen order: (B,) int64, and the number of groups G."""
    first_seen: dict[Hashable, int] = {}
    index = [first_seen.setdefault(g, len(first_seen)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(first_seen)


def group_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable], *,
                     global_std: bool = True, ddof: int = 0, eps: float = 1e-4,
                     adv_clip_max: float | None = None) -> torch.Tensor:
    """A_i = (R_i - mean_{j in g(i)} R_j) / (std + eps), optionally clipped to +-adv_clip_max.

    FlowGRPO's group-relative advantage. `global_std=True` (the SD3 recipe's default) divides by
    the std of ALL rewards in the batch, else by the group's own std.
    `ddof=0` is the population std (numpy's default, the FlowGRPO recipe); `ddof=1` the sample
    std (torch's default). A group too small for its std (size <= ddof, e.g. a
    single sample) has A = 0: its deviation from its own mean is exactly 0.

    Args:
        rewards: (B,) total reward per sample.
        group_ids: B hashable keys (prompt id); samples with equal keys form a group.
    Returns:
        (B,) float32 advantages, zero-mean within every group.
    """
    _check_rewards(rewards, group_ids)
    if eps <= 0:
        raise ConfigError("eps must be > 0", field="eps", expected="> 0", actual=eps)
    if ddof not in (0, 1):
        raise ConfigError("ddof must be 0 or 1", field="ddof", expected=(0, 1), actual=ddof)
    if adv_clip_max is not None and adv_clip_max <= 0:
        raise ConfigError("adv_clip_max must be > 0", field="adv_clip_max", actual=adv_clip_max)
    r = rewards.double()                                                    # (B,)
    index, num_groups = group_index(group_ids)                              # (B,), G
    counts = torch.bincount(index, minlength=num_groups).double()           # (G,)
    means = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, index, r) / counts  # (G,)
    centred = r - means[index]                                              # (B,)
    if global_std:
        if r.shape[0] <= ddof:
            std = torch.zeros_like(r)
        else:
            std = r.std(correction=ddof).expand_as(r)                       # (B,)
    else:
        sq = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, index, centred ** 2)  # (G,)
        dof = (counts - ddof).clamp(min=1.0)
        std = (sq / dof).sqrt()[index]                                      # (B,)
    advantages = centred / (std + eps)
    advantages = torch.where(counts[index] > ddof, advantages, torch.zeros_like(advantages))
    if adv_clip_max is not None:
        advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    return advantages.float()


class StdScope(str, Enum):
    """Which rewards the advantage's std is taken over."""

    GLOBAL = "global"   # every reward of the batch (FlowGRPO / DiffusionNFT SD3 recipes)
    GROUP = "group"     # the prompt group's own rewards


def per_reward_advantages(rewards: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                          group_ids: Sequence[Hashable], *, ddof: int = 0, eps: float = 1e-4
                          ) -> torch.Tensor:
    """GDPO-style multi-reward advantage (Liu et al. 2026, arXiv 2601.05242): each reward is
    normalised within its prompt group first, the normalised rewards are combined, and the sum is
    normalised over the batch:

        A_k,i = (R_k,i - mean_{g(i)} R_k) / (std_{g(i)} R_k + eps)      per reward k
        S_i   = sum_k w_k A_k,i / sum_k w_k        (k over the rewards present for sample i)
        A_i   = (S_i - mean_B S) / (std_B S + eps)

    so a reward's scale cannot swamp another's: each contributes in units of its own spread.
    A missing reward (NaN: an optional scorer was MISSING) is left out of that sample's sum and
    the weights renormalised, as in the total; its group statistics use the present samples.

    Args:
        rewards: scorer -> (B,) values (NaN where missing). weights: scorer -> weight > 0.
        group_ids: B keys; equal keys form a group.
    Returns:
        (B,) float32 advantages.
    """
    if not rewards:
        raise ConfigError("per-reward advantages need at least one reward", field="rewards",
                          actual={})
    missing = sorted(set(rewards) - set(weights))
    if missing:
        raise ConfigError("no weight for rewards", field="weights", expected=sorted(rewards),
                          actual=sorted(weights))
    if any(float(weights[k]) <= 0 for k in rewards):
        raise ConfigError("reward weights must be > 0", field="weights", actual=dict(weights))
    index, num_groups = group_index(group_ids)
    num = torch.zeros(len(group_ids), dtype=torch.float64)
    den = torch.zeros(len(group_ids), dtype=torch.float64)
    for name, values in rewards.items():
        if values.ndim != 1 or values.shape[0] != len(group_ids):
            raise InvalidRequestError("one value per sample for every reward",
                                      field=f"rewards.{name}", expected=(len(group_ids),),
                                      actual=tuple(values.shape))
        if torch.isinf(values).any():
            raise NonFiniteError("reward holds Inf", field=f"rewards.{name}")
        present = ~torch.isnan(values)
        if not present.any():
            continue
        sub = group_advantages(values[present], [g for g, p in zip(group_ids, present) if p],
                               global_std=False, ddof=ddof, eps=eps).double()
        adv = torch.zeros(len(group_ids), dtype=torch.float64)
        adv[present] = sub
        w = float(weights[name])
        num += w * adv
        den += w * present.double()
    if (den == 0).any():
        rows = torch.nonzero(den == 0).flatten().tolist()
        raise InvalidRequestError("samples without any reward present", field="rewards",
                                  actual=rows)
    combined = num / den                                                     # (B,)
    if combined.shape[0] <= ddof:
        return torch.zeros_like(combined).float()
    return ((combined - combined.mean()) / (combined.std(correction=ddof) + eps)).float()


def zero_advantage_groups(advantages: torch.Tensor, group_ids: Sequence[Hashable]
                          ) -> torch.Tensor:
    """(B,) bool: True for the rows of groups whose advantages are all exactly zero (every reward
    of the group equal, or a group too small for its std)."""
    index, num_groups = group_index(group_ids)
    nonzero = torch.zeros(num_groups, dtype=torch.long).index_add_(
        0, index, (advantages != 0).long())
    return nonzero[index] == 0


class ZeroAdvantageRule(str, Enum):
    """Which rows whose advantage is exactly 0 an update leaves out (before the loss's count)."""

    KEEP = "keep"      # every row trains (DiffusionNFT: A = 0 is r = 1/2, a loss term of its own)
    ROWS = "rows"      # every row with A = 0, a row at its group's mean too (flow_grpo)
    GROUPS = "groups"  # only the rows of groups whose advantages are all 0


# what each algorithm's reference code does: DiffusionNFT's scripts/train_nft_sd3.py trains the
# collated samples unfiltered; flow_grpo's scripts/train_sd3.py and train_sd3_fast.py keep
# `advantages.abs().sum(dim=1) != 0`, per row (then re-add random dropped rows until the count
# divides their number of micro-batches: not done here, micro-batches take any row count).
# (DPO trains (best, worst) pairs: tied groups yield none, as Diffusion-DPO drops ties.)
REFERENCE_ZERO_ADVANTAGE = {Algorithm.NFT: ZeroAdvantageRule.KEEP,
                            Algorithm.FLOW_GRPO: ZeroAdvantageRule.ROWS,
                            Algorithm.AWM: ZeroAdvantageRule.KEEP}


def zero_advantage_rows(advantages: torch.Tensor, group_ids: Sequence[Hashable],
                        rule: ZeroAdvantageRule) -> torch.Tensor:
    """(B,) bool: True for the rows `rule` leaves out of the update."""
    rule = ZeroAdvantageRule(rule)
    if rule is ZeroAdvantageRule.KEEP:
        return torch.zeros(advantages.shape[0], dtype=torch.bool)
    if rule is ZeroAdvantageRule.ROWS:
        return advantages == 0
    return zero_advantage_groups(advantages, group_ids)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float,
                           mode: AdvantageMode = AdvantageMode.CONTINUOUS) -> torch.Tensor:
    """DiffusionNFT optimality probability r = clamp(A'/c/2 + 1/2, 0, 1), c = adv_clip_max.

    DiffusionNFT's optimality probability with Z_c = c * std; A' is A transformed by `mode`
    (see AdvantageMode).
    Table for CONTINUOUS, c = 5: A in {-10,-5,-2.5,0,2.5,5,10} -> r in {0,0,.25,.5,.75,1,1}.

    Args:
        advantages: (B,) advantages. Returns (B,) r in [0, 1], same dtype.
    """
    if adv_clip_max <= 0:
        raise ConfigError("adv_clip_max must be > 0", field="adv_clip_max", actual=adv_clip_max)
    if not torch.isfinite(advantages).all():
        raise NonFiniteError("advantages hold NaN/Inf", field="advantages")
    c = adv_clip_max
    mode = AdvantageMode(mode)
    if mode is AdvantageMode.CONTINUOUS:
        a = advantages.clamp(-c, c)
    elif mode is AdvantageMode.POSITIVE_ONLY:
        a = advantages.clamp(0.0, c)
    elif mode is AdvantageMode.NEGATIVE_ONLY:
        a = advantages.clamp(-c, 0.0)
    elif mode is AdvantageMode.ONE_ONLY:
        a = (advantages > 0).to(advantages.dtype)
    else:  # BINARY
        a = torch.sign(advantages)
    return (a / c / 2.0 + 0.5).clamp(0.0, 1.0)


@dataclass(frozen=True)
class PreferencePairs:
    """(winner, loser) sample indices, one pair per group with a strict reward preference.

    winner, loser: (P,) int64 indices into the batch; groups: the P group ids, in pair order.
    """

    winner: torch.Tensor
    loser: torch.Tensor
    groups: tuple[Hashable, ...]

    @property
    def num_pairs(self) -> int:
        return int(self.winner.shape[0])


def best_worst_pairs(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> PreferencePairs:
    """Per group: winner = argmax R, loser = argmin R (first index on ties).

    Diffusion-DPO (arXiv 2311.12908) trained on online pairs: the best and worst sample per
    prompt. Groups whose rewards are all equal (including single-sample groups)
    carry no preference and yield no pair; the caller decides what an empty batch means.
    """
    _check_rewards(rewards, group_ids)
    index, num_groups = group_index(group_ids)
    keys = list(dict.fromkeys(group_ids))
    winners, losers, groups = [], [], []
    for g in range(num_groups):
        members = torch.nonzero(index == g).flatten()                       # (n_g,)
        values = rewards[members]
        best, worst = members[values.argmax()], members[values.argmin()]
        if rewards[best] > rewards[worst]:
            winners.append(int(best))
            losers.append(int(worst))
            groups.append(keys[g])
    return PreferencePairs(torch.tensor(winners, dtype=torch.long),
                           torch.tensor(losers, dtype=torch.long), tuple(groups))
