"""Advantages, NFT optimality probability and DPO pairs against an independent numpy derivation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError, NonFiniteError
from trainer.algorithms import (AdvantageMode, best_worst_pairs, group_advantages,
                                optimality_probability)


def _numpy_advantages(rewards, groups, global_std, ddof, eps):
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    for g in set(groups):
        idx = np.array([i for i, k in enumerate(groups) if k == g])
        if len(idx) <= ddof:
            continue
        std = np.std(rewards, ddof=ddof) if global_std else np.std(rewards[idx], ddof=ddof)
        out[idx] = (rewards[idx] - rewards[idx].mean()) / (std + eps)
    return out


@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
def test_matches_numpy_and_zero_mean_per_group(global_std, ddof):
    gen = np.random.default_rng(0)
    rewards = gen.normal(size=12)
    groups = ["a", "b", "c"] * 4
    got = group_advantages(torch.tensor(rewards), groups, global_std=global_std, ddof=ddof)
    want = _numpy_advantages(rewards, groups, global_std, ddof, 1e-4)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    for g in "abc":
        members = [i for i, k in enumerate(groups) if k == g]
        assert abs(float(got[members].sum())) < 1e-5
    assert got.abs().max() > 0.1     # non-trivial


def test_single_element_groups_give_zero():
    rewards = torch.tensor([3.0, -1.0, 7.0, 0.5, 0.7])
    groups = [0, 1, 2, 3, 3]
    for global_std in (True, False):
        for ddof in (0, 1):
            a = group_advantages(rewards, groups, global_std=global_std, ddof=ddof)
            assert torch.equal(a[:3], torch.zeros(3))
            assert a[3] < 0 < a[4]


def test_clip_to_adv_clip_max():
    rewards = torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0, 0.0])
    a = group_advantages(rewards, [0] * 6, global_std=False, adv_clip_max=2.0)
    assert float(a.max()) == 2.0 and float(a.min()) >= -2.0


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(InvalidRequestError, match="group"):
        group_advantages(torch.zeros(3), [0, 1])
    with pytest.raises(NonFiniteError):
        group_advantages(torch.tensor([0.0, float("nan")]), [0, 0])
    with pytest.raises(ConfigError, match="ddof"):
        group_advantages(torch.zeros(2), [0, 0], ddof=2)
    with pytest.raises(InvalidRequestError, match="1-D"):
        group_advantages(torch.zeros(2, 2), [0, 0])


def test_optimality_table_continuous():
    a = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    r = optimality_probability(a, adv_clip_max=5.0)
    assert r.tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("mode,expected", [
    (AdvantageMode.POSITIVE_ONLY, [0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]),
    (AdvantageMode.NEGATIVE_ONLY, [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]),
    (AdvantageMode.ONE_ONLY, [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),
    (AdvantageMode.BINARY, [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6]),
])
def test_optimality_modes(mode, expected):
    a = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0], dtype=torch.float64)
    r = optimality_probability(a, adv_clip_max=5.0, mode=mode)
    np.testing.assert_allclose(r.numpy(), expected, atol=1e-12)


def test_best_worst_pairs():
    rewards = torch.tensor([0.1, 0.9, 0.5, 2.0, 2.0, 4.0, -1.0, 3.0])
    groups = ["p", "p", "p", "q", "q", "r", "s", "s"]
    pairs = best_worst_pairs(rewards, groups)
    # q: tie -> no pair; r: single sample -> no pair
    assert pairs.groups == ("p", "s")
    assert pairs.winner.tolist() == [1, 7] and pairs.loser.tolist() == [0, 6]
    assert (rewards[pairs.winner] > rewards[pairs.loser]).all()
