"""FlowGRPO's old-policy log-probs (trainer/algorithms/flow_grpo.py OldLogProbs, updates.py):
rows the learner's old policy sampled keep their stored rollout log-probs (no recompute
forward), rows of another version are recomputed, and the step equals the recomputing one
within the parity tolerance; a reuse where the versions differ is a typed error naming both.
Real embedded engine and learner (no Ray)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from testing.logprob_reuse import VERSION, flow_grpo_batch, grpo_step
from contract import PolicyVersionError
from trainer.algorithms import OldLogProbs, reusable_rows, rollout_old_log_probs
from trainer.updates import plan_update


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    return flow_grpo_batch()


def _step(learner, cfg, batch, mode: OldLogProbs, old_version: str):
    grads, metrics, forwards, _ = grpo_step(learner, cfg, batch, mode, old_version)
    return grads, metrics, forwards


def test_reuse_equals_recompute_with_half_the_forwards(setup):
    learner, cfg, batch = setup
    reused, m_reuse, f_reuse = _step(learner, cfg, batch, OldLogProbs.ROLLOUT, VERSION)
    recomputed, m_rec, f_rec = _step(learner, cfg, batch, OldLogProbs.RECOMPUTE, VERSION)
    assert m_reuse["old_logprob_reused_rows"] == batch.rows and \
        m_rec["old_logprob_reused_rows"] == 0
    assert f_rec == 2 * f_reuse > 0            # the recompute is one extra forward per step
    # the rollout's log-probs equal the learner's within the parity tolerance: same step
    for a, b in zip(reused, recomputed):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-7)
    assert abs(m_reuse["loss"] - m_rec["loss"]) <= 1e-4 * max(1.0, abs(m_rec["loss"]))


def test_rows_of_another_version_are_recomputed(setup):
    """The learner moved on (an async batch sampled before the last update): its old policy is
    not the rows' version, so nothing is reused, never silently."""
    learner, cfg, batch = setup
    _, metrics, forwards = _step(learner, cfg, batch, OldLogProbs.ROLLOUT, "t-v1")
    _, _, recompute_forwards = _step(learner, cfg, batch, OldLogProbs.RECOMPUTE, "t-v1")
    assert metrics["old_logprob_reused_rows"] == 0 and forwards == recompute_forwards


def test_reuse_where_versions_differ_is_a_typed_error():
    log_probs = torch.zeros(3)
    assert rollout_old_log_probs(log_probs, ["v2"] * 3, "v2") is log_probs
    with pytest.raises(PolicyVersionError) as e:
        rollout_old_log_probs(log_probs, ["v2", "v1", "v2"], "v2")
    assert (e.value.field, e.value.expected, e.value.actual) == ("versions[1]", "v2", "v1")
    assert reusable_rows(OldLogProbs.ROLLOUT, ["v2", "v1"], "v2").tolist() == [True, False]
    assert reusable_rows(OldLogProbs.RECOMPUTE, ["v2", "v1"], "v2").tolist() == [False, False]


def test_a_batch_of_several_versions_needs_the_old_version_stated(setup):
    learner, cfg, batch = setup
    mixed = dataclasses.replace(batch, versions=("a",) * 4 + ("b",) * 4)
    with pytest.raises(PolicyVersionError) as e:
        plan_update(cfg.algorithm, mixed, cfg, torch.Generator().manual_seed(0))
    assert e.value.field == "old_version"
