"""Run state pieces: the evaluation EMA, the generator round trip, the config diff on resume."""
from __future__ import annotations

import pytest
import torch

from contract import ConfigError
from trainer.config import EMAConfig, TrainerConfig
from trainer.run_state import (PolicyEMA, check_resume_config, config_diff, generator_state,
                               set_generator_state)


def test_ema_decay_every_and_warmup():
    """Against tests/test_algorithms_reference_code.py's EMAModuleWrapper excerpt, derived: an
    update after step s when (s + 1) % every == 0, decay min(decay, (1 + s) / (10 + s))."""
    ema = PolicyEMA(EMAConfig(enabled=True, decay=0.9, every=2, warmup=False))
    ema.update(0, {"w": torch.zeros(3)})                       # initialised from the weights
    ema.update(1, {"w": torch.ones(3)})                        # (1 + 1) % 2 == 0: an update
    torch.testing.assert_close(ema.tensors["w"], torch.full((3,), 0.1))
    ema.update(2, {"w": torch.full((3,), 5.0)})                # not an update step
    torch.testing.assert_close(ema.tensors["w"], torch.full((3,), 0.1))
    assert EMAConfig().warmup                                  # the references always warm up
    warm = PolicyEMA(EMAConfig(enabled=True, decay=0.9))
    warm.update(0, {"w": torch.zeros(1)})
    for step in (1, 2):                                        # d_s = min(0.9, (1+s)/(10+s))
        warm.update(step, {"w": torch.ones(1)})
    d1, d2 = 2 / 11, 3 / 12
    torch.testing.assert_close(warm.tensors["w"], torch.tensor([1 - d2 * d1]))


def test_generator_state_round_trip():
    gen = torch.Generator().manual_seed(5)
    torch.randn(7, generator=gen)
    saved = generator_state(gen)
    want = torch.randn(4, generator=gen)
    other = torch.Generator().manual_seed(99)
    set_generator_state(other, saved)
    assert torch.equal(torch.randn(4, generator=other), want)


def test_config_diff_ignores_run_length_and_names_the_rest():
    a = TrainerConfig().model_dump(mode="json")
    b = TrainerConfig(steps=500, run_dir="elsewhere", eval={"every": 50},
                      advantage={"std": "group"}, seed=3).model_dump(mode="json")
    assert [d[0] for d in config_diff(a, b)] == ["advantage.std", "seed"]
    with pytest.raises(ConfigError) as e:
        check_resume_config(a, TrainerConfig(seed=3))
    assert e.value.field == "seed" and e.value.expected == {"seed": 0}
    check_resume_config(a, TrainerConfig(steps=999))


def test_a_prompt_files_negative_prompt_reaches_the_bundle(tmp_path):
    """The negative prompt of a .jsonl record is tokenized by the family's tokenizers into the
    bundle's `negative` (what the encoder stage and the learner use for CFG's branch)."""
    import json

    from adapters.registry import get_family
    from trainer.config import load_trainer_config
    from trainer.run_state import PromptFeed
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "a red circle at the top left on a black background",
         "negative_prompt": "a blue square"},
        {"prompt": "a green triangle at the bottom right on a white background"})) + "\n")
    cfg = load_trainer_config({"data": {"train": str(path)}, "eval": {"num_prompts": 2}})
    family = get_family("tiny_t2i")
    feed = PromptFeed(cfg, family.conditioner.tokenize)
    with_negative, without = feed.eval_bundles
    expected = family.conditioner.tokenize(["a blue square"])[0]
    assert with_negative.negative is not None
    assert with_negative.negative.token_ids == expected.token_ids
    assert without.negative is None
