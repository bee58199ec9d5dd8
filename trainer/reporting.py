"""What a user watches for reward hacking, per optimizer step (metrics.jsonl, TensorBoard, W&B)
and in the gallery: each scorer's mean / std (`reward_<scorer>_mean|std`, trainer/loop.py), the
share of prompt groups whose advantages are all zero and the share the update drops for it
(`zero_adv_group_share`, `dropped_group_share`), and the importance ratio and clip fraction
under the algorithm's own name (`<algorithm>/ratio_mean`, `<algorithm>/clipfrac`: FlowGRPO and
its variants, AWM; NFT and DPO have no ratio).
"""
from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence

import torch

from contract import Algorithm

RATIO_METRICS = ("ratio_mean", "clipfrac")


def group_shares(group_ids: Sequence[Hashable], tied: torch.Tensor,
                 dropped: torch.Tensor) -> dict[str, float]:
    """tied / dropped: (B,) bool per row (its group's advantages all zero / the row left out).
    A group counts as dropped when every one of its rows is."""
    groups: dict[Hashable, list[int]] = {}
    for row, g in enumerate(group_ids):
        groups.setdefault(g, []).append(row)
    n = len(groups)
    zero = sum(bool(tied[rows[0]]) for rows in groups.values())
    gone = sum(all(bool(dropped[r]) for r in rows) for rows in groups.values())
    return {"zero_adv_group_share": zero / n if n else 0.0,
            "dropped_group_share": gone / n if n else 0.0}


def ratio_report(algorithm: Algorithm, metrics: Mapping[str, float]) -> dict[str, float]:
    """The step's ratio and clip fraction under `<algorithm>/` (only those it computed)."""
    return {f"{Algorithm(algorithm).value}/{k}": float(metrics[k]) for k in RATIO_METRICS
            if k in metrics}


def scorer_summary(values: Mapping[str, Sequence[float | None]]) -> str:
    """'attr 0.812+-0.051 | clip 0.330+-0.020' over the present values of each scorer (a scorer
    missing for every sample: 'clip missing'); the std is the sample std (n - 1)."""
    parts = []
    for name, vals in values.items():
        present = [float(v) for v in vals if v is not None]
        if not present:
            parts.append(f"{name} missing")
            continue
        mean = sum(present) / len(present)
        std = (math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))
               if len(present) > 1 else 0.0)
        parts.append(f"{name} {mean:.3f}+-{std:.3f}")
    return " | ".join(parts)
