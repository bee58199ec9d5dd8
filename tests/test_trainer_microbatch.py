"""The learner on devices, in pieces: micro-batches of 1 row give the whole batch's gradient
(each algorithm), gradient checkpointing changes memory not the gradient, shards of the prompt
groups sum to the whole batch's step, a row's training draws do not depend on its batch mates,
bf16 weights train fp32 LoRA masters, and a dtype or worker count the setup cannot take is a
typed error naming the field -- before any weight is loaded."""
from __future__ import annotations

import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, ConfigError, PolicyKind
from rollout.engine import EmbeddedEngine
from tests.trainer_helpers import sampled_batch
from trainer.config import PromptSource, SamplerSettings, TrainerConfig, load_trainer_config
from trainer.learner import Learner
from trainer.learner_config import LearnerConfig
from trainer.prompts import captions
from trainer.train_noise import Draw, row_randn
from trainer.updates import UPDATES, plan_update, run_update, shard_plan


def _cfg(algorithm: Algorithm, **learner) -> TrainerConfig:
    # DPO beta 10, not 100: batched and per-row fp32 matmuls differ by ~1e-6 relative, which
    # beta 100 turns into 5e-6 on gradients of size 2 (the accumulation itself is exact)
    return TrainerConfig(algorithm=algorithm, samples_per_prompt=4, prompts_per_step=2,
                         sampler=SamplerSettings(num_steps=4, window=(0, 3)),
                         nft={"train_timesteps": 2}, dpo={"draws_per_pair": 2, "beta": 10.0},
                         flow_grpo={"kl_beta": 0.01}, learner=learner)


def _learner(family, transformers, **learner) -> Learner:
    cfg = _cfg(Algorithm.NFT, **learner)
    out = Learner(family, copy.deepcopy(transformers), family.load_encoders(), cfg.lora,
                  cfg.optimizer, settings=cfg.learner)
    with torch.no_grad():   # a nonzero adapter, so the current policy differs from the base
        for p in out.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return out


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    transformers = family.load_transformers()
    learner = _learner(family, transformers)
    engine = EmbeddedEngine(family, copy.deepcopy(transformers), {})
    tensors, scale = learner.export()
    engine.load_lora("mb-v0", tensors, scale)
    prompts = family.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 0))
    batch = sampled_batch(learner, engine, prompts, _cfg(Algorithm.NFT).sampler, 4, 0, "mb-v0")
    yield family, transformers, learner, batch


def _grads(learner, cfg, plan_or_batch, plans=None):
    """Gradients (and metrics) of one update with the optimizer step captured, not taken."""
    captured = []

    def capture():
        captured.append([p.grad.detach().clone() for p in learner.params])
        learner.optimizer.zero_grad(set_to_none=True)
        return 1.0
    real, learner.step = learner.step, capture
    try:
        if plans is None:
            metrics = UPDATES[cfg.algorithm](learner, plan_or_batch, cfg,
                                             torch.Generator().manual_seed(0))
        else:
            metrics = [run_update(learner, p, cfg) for p in plans]
    finally:
        learner.step = real
    return captured, metrics


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_micro_batches_of_one_row_give_the_whole_batch_gradient(setup, algorithm):
    family, transformers, learner, batch = setup
    whole, m_whole = _grads(learner, _cfg(algorithm), batch)
    micro, m_micro = _grads(learner, _cfg(algorithm, micro_batch_size=1), batch)
    assert len(whole) == len(micro) == 1
    assert max(float(g.abs().max()) for g in whole[0]) > 1e-4       # a real gradient
    assert _max_diff(whole[0], micro[0]) <= 1e-6
    assert set(m_whole) == set(m_micro)
    for key in m_whole:
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key


def test_gradient_checkpointing_changes_memory_not_the_gradient(setup):
    family, transformers, learner, batch = setup
    checkpointed = _learner(family, transformers, gradient_checkpointing=True)
    assert checkpointed.transformer.gradient_checkpointing
    for algorithm in (Algorithm.NFT, Algorithm.FLOW_GRPO):
        plain, _ = _grads(learner, _cfg(algorithm), batch)
        ckpt, _ = _grads(checkpointed, _cfg(algorithm, gradient_checkpointing=True), batch)
        assert _max_diff(plain[0], ckpt[0]) <= 1e-6


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_shards_of_prompt_groups_sum_to_the_whole_batch_step(setup, algorithm):
    """Two workers' shards of the same plan (here run one after the other on one learner):
    their gradients and metric sums add up to the whole batch's; with `balance` the shards run
    the same number of micro-batches (padding ones weigh 0)."""
    family, transformers, learner, batch = setup
    cfg = _cfg(algorithm, micro_batch_size=2)
    whole, m_whole = _grads(learner, cfg, batch)
    plan = plan_update(algorithm, batch, cfg, torch.Generator().manual_seed(0))
    shards = [shard_plan(plan, r, 2, 2, balance=True) for r in range(2)]
    assert [set(s.batch.group_ids) for s in shards] == [{g} for g in dict.fromkeys(
        batch.group_ids)]
    parts, metrics = _grads(learner, cfg, None, shards)
    summed = [a + b for a, b in zip(*parts)]
    assert _max_diff(whole[0], summed) <= 1e-6
    for key in m_whole:
        if key == "grad_norm":
            continue
        local = [m[key] for m in metrics]
        total = local[0] if key in plan.metrics else sum(local)
        assert total == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key


def test_a_rows_training_noise_does_not_depend_on_its_batch_mates():
    alone = row_randn(7, [1234], Draw.NFT_NOISE, 3, (4, 8, 8))
    among = row_randn(7, [99, 1234, 5], Draw.NFT_NOISE, 3, (4, 8, 8))
    assert torch.equal(alone[0], among[1])
    assert not torch.equal(among[0], among[1])
    assert not torch.equal(row_randn(7, [1234], Draw.NFT_NOISE, 2, (4, 8, 8)), alone)
    assert not torch.equal(row_randn(8, [1234], Draw.NFT_NOISE, 3, (4, 8, 8)), alone)


def test_bf16_weights_train_fp32_lora_masters(setup):
    family, transformers, _, batch = setup
    learner = _learner(family, transformers, dtype="bfloat16")
    base = next(p for n, p in learner.transformer.named_parameters() if "lora" not in n)
    assert base.dtype == torch.bfloat16 and {p.dtype for p in learner.params} == {torch.float32}
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.NFT](learner, batch, _cfg(Algorithm.NFT, dtype="bfloat16"),
                                     torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0 and all(torch.isfinite(p).all() for p in learner.params)
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
    v = learner.velocity(batch.x0[:2], torch.full((2,), 0.5), batch.cond.index_select(
        torch.arange(2)))
    assert v.dtype == torch.float32


def test_full_fine_tuning_trains_every_weight_and_exports_them(setup):
    family, transformers, _, batch = setup
    cfg = _cfg(Algorithm.FLOW_GRPO, fine_tune="full")
    learner = Learner(family, copy.deepcopy(transformers), family.load_encoders(), cfg.lora,
                      cfg.optimizer, settings=cfg.learner)
    assert learner.kind is PolicyKind.FULL
    n_params = sum(1 for _ in learner.transformer.parameters())
    assert len(learner.params) == n_params
    tensors, scale = learner.export()
    assert scale == 1.0 and len(tensors) == n_params and not any("lora" in k for k in tensors)
    metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0
    after, _ = learner.export()
    moved = [k for k in tensors if not torch.equal(tensors[k], after[k])]
    assert len(moved) > n_params // 2
    old, _ = learner.export("old")               # old and reference stay the base weights
    assert all(torch.equal(old[k], tensors[k]) for k in tensors)
    learner.refresh_old(0.0)
    assert all(torch.equal(learner.export("old")[0][k], after[k]) for k in after)


def test_a_dtype_or_device_the_machine_lacks_fails_before_loading(monkeypatch):
    family = TinyT2IFamily()
    monkeypatch.setattr(family, "load_transformers", lambda *a, **k: pytest.fail("loaded"))
    cfg = TrainerConfig(learner={"dtype": "float16"})
    with pytest.raises(ConfigError) as e:
        Learner.load(family, cfg.lora, cfg.optimizer, settings=cfg.learner)
    assert e.value.field == "learner.dtype" and e.value.actual == "float16"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as e:
            LearnerConfig(device="cuda").check_device()
        assert e.value.field == "learner.device" and e.value.actual == "cuda"
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"learner": {"dtype": "float8"}})
    assert e.value.field == "learner.dtype"


def test_a_worker_count_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"prompts_per_step": 4, "learner": {"workers": 3}})
    assert e.value.field == "learner.workers" and e.value.actual == 3
    assert load_trainer_config({"prompts_per_step": 4,
                                "learner": {"workers": 2}}).learner.workers == 2
    with pytest.raises(ConfigError) as e:
        load_trainer_config({"learner": {"placement": "colocated"}})
    assert e.value.field == "learner.placement"

