"""Per-step reporting for reward hacking: zero-advantage group shares from the advantages the
update uses, the ratio and clip fraction under the algorithm's name, per-scorer mean / std in the
gallery's group captions, and all of them as TensorBoard scalars."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from contract import Algorithm, RewardReport, RolloutOutput
from trainer.config import TrainerConfig
from trainer.reporting import group_shares, ratio_report, scorer_summary
from trainer.updates import advantages


def test_group_shares_count_tied_and_fully_dropped_groups():
    ids = ["a", "a", "b", "b", "c", "c"]
    tied = torch.tensor([True, True, False, False, False, False])
    dropped = torch.tensor([True, True, True, False, False, False])   # b loses one row only
    assert group_shares(ids, tied, dropped) == {"zero_adv_group_share": pytest.approx(1 / 3),
                                                "dropped_group_share": pytest.approx(1 / 3)}


@pytest.mark.parametrize("algorithm, dropped", [(Algorithm.FLOW_GRPO, 0.5), (Algorithm.NFT, 0.0)])
def test_advantages_report_the_shares_their_rule_gives(algorithm, dropped):
    """Two groups, one with equal rewards: half the groups are tied; FlowGRPO drops that group's
    rows (flow_grpo's mask), NFT trains every row (DiffusionNFT)."""
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 1.0, 0.2, 0.9]),
                            group_ids=("g0", "g0", "g1", "g1"), rows=4,
                            select=lambda index: SimpleNamespace(rows=len(index)))
    _, _, metrics = advantages(algorithm, batch, TrainerConfig(algorithm=algorithm), 5.0)
    assert metrics["zero_adv_group_share"] == 0.5
    assert metrics["dropped_group_share"] == dropped


def test_ratio_and_clip_fraction_under_the_algorithms_name():
    m = {"ratio_mean": 1.01, "clipfrac": 0.25, "loss": 0.3}
    assert ratio_report(Algorithm.FLOW_GRPO, m) == {"flow_grpo/ratio_mean": 1.01,
                                                    "flow_grpo/clipfrac": 0.25}
    assert ratio_report(Algorithm.NFT, {"loss": 0.1}) == {}


def test_gallery_group_captions_and_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.gallery import group_summaries
    from trainer.logs import MetricsLogger
    report = RewardReport({}, (0.5, 0.7, 0.9), {"attr": 1.0, "clip": 1.0},
                          {"attr": (0.5, 0.7, 0.9), "clip": (None, None, None)})
    out = RolloutOutput("r", {}, None, "v", (1, 2, 3), rewards=report)
    assert group_summaries([out]) == ["attr 0.700+-0.200 | clip missing"]
    assert scorer_summary({"a": (1.0,)}) == "a 1.000+-0.000"
    logger = MetricsLogger(tmp_path)
    logger.log(3, {"reward_attr_mean": 0.7, "reward_attr_std": 0.2, "zero_adv_group_share": 0.5,
                   "dropped_group_share": 0.25, "flow_grpo/ratio_mean": 1.01,
                   "flow_grpo/clipfrac": 0.125})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for tag, value in (("zero_adv_group_share", 0.5), ("flow_grpo/clipfrac", 0.125),
                       ("reward_attr_std", 0.2)):
        [scalar] = events.Scalars(tag)
        assert scalar.step == 3 and scalar.value == pytest.approx(value)
