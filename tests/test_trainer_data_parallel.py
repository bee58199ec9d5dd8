"""Data parallel on Ray Train: 2 learner workers (gloo, 0.5 CPU each, in the shared test
cluster) take the step one learner takes on the union batch -- parameters within 1e-6, the same
metrics -- for LoRA (all-reduce of the adapter's gradients) and for full fine-tuning sharded
with FSDP2."""
from __future__ import annotations

import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm
from rollout.engine import EmbeddedEngine
from tests.trainer_helpers import sampled_batch
from trainer.config import PromptSource, load_trainer_config
from trainer.distributed import Colocation, RayTrainLearners
from trainer.learner import Learner
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.prompts import captions
from trainer.updates import UPDATES

pytestmark = pytest.mark.timeout(900)


def _cfg(tmp_path, **learner):
    return load_trainer_config({
        "graph": {"app_name": "dp_unused", "rollout": {"adapter": "tiny_t2i"}},
        "samples_per_prompt": 4, "prompts_per_step": 2,
        "sampler": {"sampler": "sde", "num_steps": 4, "window": [0, 3]},
        "lora": {"rank": 4, "alpha": 8}, "optimizer": {"lr": 1e-2, "eps": 1e-4},
        "nft": {"train_timesteps": 2}, "dpo": {"draws_per_pair": 1, "beta": 10.0},
        "flow_grpo": {"kl_beta": 0.01}, "run_dir": str(tmp_path), "learner": learner})


def _batch(learner, cfg):
    family = learner.family
    engine = EmbeddedEngine(family, {"transformer": copy.deepcopy(
        family.load_transformers()["transformer"])}, {})
    prompts = family.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 4))
    return sampled_batch(learner, engine, prompts, cfg.sampler, 4, 11, "base")


def _assert_same(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=atol, msg=key)


def _assert_metrics(want: dict, got: dict) -> None:
    assert set(want) == set(got)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def _pair(tmp_path, **learner):
    """(single learner, 2-worker group (its policy: rank 0's exports), the single learner's
    config). Both run forwards of `micro_batch_size` rows: the same shapes, so the float
    results differ only by the order of the gradient sums (a whole-batch forward differs from
    per-row ones at 1e-7 relative -- tests/test_trainer_microbatch.py). AdamW's eps is 1e-4:
    at 1e-8 its first steps are lr * sign(g), which turns rounding noise in gradients near 0
    into parameter differences of up to lr."""
    torch.set_num_threads(1)                  # as each worker (and the trainer) runs
    cfg1 = _cfg(tmp_path / "one", **learner)
    cfg2 = _cfg(tmp_path / "two", workers=2, resources_per_worker={"CPU": 0.5}, **learner)
    family = TinyT2IFamily()
    one = Learner.load(family, cfg1.lora, cfg1.optimizer, cfg1.seed, cfg1.learner)
    group = RayTrainLearners(cfg2, cfg2.graph_config(), tmp_path, Colocation(None))
    return one, group, cfg1


def test_two_lora_workers_take_the_union_batch_step(ray_cluster, tmp_path):
    one, group, cfg = _pair(tmp_path, micro_batch_size=2)
    try:
        _assert_same(one.export()[0], group.export()[0])        # same start
        batch = _batch(one, cfg)
        assert len(set(batch.group_ids)) == 2                            # one group per worker
        for algorithm in (Algorithm.NFT, Algorithm.FLOW_GRPO, Algorithm.DPO):
            want = UPDATES[algorithm](one, batch, cfg, torch.Generator().manual_seed(3))
            got = group.update(batch, torch.Generator().manual_seed(3), algorithm)
            assert want["grad_norm"] > 0
            _assert_metrics(want, got)
            _assert_same(one.export()[0], group.export()[0])
        one.refresh_old(0.25)
        group.refresh_old(0.25)
        _assert_same(one.export(OLD_ADAPTER)[0], group.export(OLD_ADAPTER)[0])
        state = group.optimizer_state()                                  # rank 0's AdamW
        mine = one.optimizer.state_dict()
        for i, s in mine["state"].items():
            torch.testing.assert_close(state["state"][i]["exp_avg_sq"], s["exp_avg_sq"],
                                       rtol=1e-5, atol=1e-9)
        group.load_state({TRAIN_ADAPTER: one.export()[0]}, mine)      # resume path: no error
    finally:
        group.close()
    assert not group._thread.is_alive() and "error" not in group._result


def test_two_fsdp2_workers_take_the_union_batch_full_fine_tuning_step(ray_cluster, tmp_path):
    one, group, cfg = _pair(tmp_path, fine_tune="full", micro_batch_size=4)
    try:
        batch = _batch(one, cfg)
        for algorithm in (Algorithm.FLOW_GRPO, Algorithm.NFT):
            want = UPDATES[algorithm](one, batch, cfg, torch.Generator().manual_seed(5))
            got = group.update(batch, torch.Generator().manual_seed(5), algorithm)
            _assert_metrics(want, got)
            _assert_same(one.export()[0], group.export()[0])
        one.refresh_old(0.0)
        group.refresh_old(0.0)
        _assert_same(one.export(OLD_ADAPTER)[0], group.export(OLD_ADAPTER)[0])
    finally:
        group.close()
