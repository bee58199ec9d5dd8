"""Advantages, NFT optimality probability and DPO pairs against an independent numpy derivation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError, NonFiniteError
from trainer.algorithms import (AdvantageMode, best_worst_pairs, group_advantages,
                                optimality_probability, per_reward_advantages,
                                zero_advantage_groups)


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


def _numpy_gdpo(rewards, weights, groups, ddof, eps):
    """Per reward: group z-score; weighted mean over the present rewards; batch z-score."""
    names = list(rewards)
    n = len(groups)
    num, den = np.zeros(n), np.zeros(n)
    for k in names:
        r = np.asarray(rewards[k], dtype=np.float64)
        adv = np.zeros(n)
        for g in set(groups):
            idx = [i for i in range(n) if groups[i] == g and not np.isnan(r[i])]
            if len(idx) > ddof:
                vals = r[idx]
                adv[idx] = (vals - vals.mean()) / (np.std(vals, ddof=ddof) + eps)
        present = ~np.isnan(r)
        num[present] += weights[k] * adv[present]
        den[present] += weights[k]
    s = num / den
    return (s - s.mean()) / (np.std(s, ddof=ddof) + eps)


def test_per_reward_advantages_match_numpy_with_a_missing_score():
    gen = np.random.default_rng(3)
    groups = ["p", "q", "r"] * 4
    rewards = {"pick": gen.normal(size=12), "ocr": gen.uniform(size=12)}
    rewards["ocr"][4] = np.nan                        # optional scorer MISSING for one sample
    weights = {"pick": 1.0, "ocr": 0.5}
    for ddof in (0, 1):
        got = per_reward_advantages({k: torch.tensor(v) for k, v in rewards.items()}, weights,
                                    groups, ddof=ddof)
        np.testing.assert_allclose(got.numpy(), _numpy_gdpo(rewards, weights, groups, ddof,
                                                            1e-4), rtol=1e-5, atol=1e-6)


def test_per_reward_advantages_keep_a_small_reward_from_being_swamped():
    """An aesthetic-like reward in the hundreds and an OCR-like reward in [0, 0.05]: under the
    weighted total the advantage follows the large one alone; per reward, both count equally and
    rescaling either reward changes nothing."""
    gen = np.random.default_rng(7)
    groups = [g for g in range(6) for _ in range(8)]
    big = torch.tensor(300 + 40 * gen.normal(size=48))
    small = torch.tensor(0.05 * gen.uniform(size=48))
    weights = {"aesthetic": 1.0, "ocr": 1.0}
    total = group_advantages(big + small, groups)
    per = per_reward_advantages({"aesthetic": big, "ocr": small}, weights, groups)
    z_small = per_reward_advantages({"ocr": small}, {"ocr": 1.0}, groups)
    corr = lambda a, b: float(np.corrcoef(a.numpy(), b.numpy())[0, 1])
    assert abs(corr(total, z_small)) < 0.3            # the small reward is invisible in the sum
    assert corr(per, z_small) > 0.6                   # and counts once normalised on its own
    exact = per_reward_advantages({"aesthetic": big, "ocr": small}, weights, groups, eps=1e-9)
    rescaled = per_reward_advantages({"aesthetic": big * 1000, "ocr": small / 10}, weights,
                                     groups, eps=1e-9)
    torch.testing.assert_close(rescaled, exact, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="weight"):
        per_reward_advantages({"aesthetic": big}, {}, groups)
    with pytest.raises(InvalidRequestError, match="one value per sample"):
        per_reward_advantages({"ocr": small[:3]}, {"ocr": 1.0}, groups)


def test_zero_advantage_groups_are_found():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.2, 0.9, 0.5, 0.5, 7.0])
    groups = ["a", "a", "a", "b", "b", "c", "c", "d"]          # a: tied, c: tied, d: single
    adv = group_advantages(rewards, groups)
    assert zero_advantage_groups(adv, groups).tolist() == [True] * 3 + [False] * 2 + [True] * 3
