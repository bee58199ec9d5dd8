"""trainer/checkpointing.py in process (no Ray): Checkpoints built from the objects it saves --
a real tiny learner, the prompt feed, the generator -- writes the loop's counters it is given
and restores those objects in place; a changed config is refused before anything is restored.
The whole run's exact resume through the graph: tests/test_trainer_resume.py."""
from __future__ import annotations

import json

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import ConfigError
from trainer.checkpointing import Checkpoints, Resumed
from trainer.config import TrainerConfig
from trainer.distributed import Colocation, LocalLearners
from trainer.learner import Learner
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.run_state import PromptFeed

PROMPTS = [f"a {c} {s}" for c in ("red", "green", "blue") for s in ("circle", "square", "star")]


def _config(tmp_path, **over) -> TrainerConfig:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return TrainerConfig(**{"data": {"train": str(prompts)}, "eval": {"num_prompts": 2},
                            "run_dir": str(tmp_path / "run"), **over})


def _texts(feed: PromptFeed, step: int) -> list[str]:
    return [b.text for b in feed.batch(step, 3).bundles]


def _moved(learner: Learner, seed: int) -> None:
    with torch.no_grad():
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _objects(cfg: TrainerConfig):
    """What Checkpoints saves and restores: a real tiny learner (and its local group), the
    prompt feed and the loop's generator."""
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    learner = Learner(family, family.load_transformers(), family.load_encoders(), cfg.lora,
                      cfg.optimizer)
    return (learner, LocalLearners(cfg, learner, Colocation(None)),
            PromptFeed(cfg, family.conditioner.tokenize), torch.Generator().manual_seed(cfg.seed))


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    return {f"{n}/{k}": v.clone() for n in (TRAIN_ADAPTER, OLD_ADAPTER)
            for k, v in learner.export(n)[0].items()}


def test_save_then_load_restores_the_objects_and_returns_the_counters(tmp_path):
    cfg = _config(tmp_path)
    learner, learners, feed, gen = _objects(cfg)
    run_dir = tmp_path / "run"
    # publisher: not reached -- nothing is in flight and the in-flight tensors are the current
    checkpoints = Checkpoints(run_dir, cfg, learners, None, feed, None, gen)
    _moved(learner, 1)
    learner.refresh_old(0.5)
    _texts(feed, 0)                                  # the feed has moved on
    torch.rand(5, generator=gen)                     # and so has the generator
    path = checkpoints.save(3, ["run/v2", "run/v3"], dropped_stale_rows=2, rollout_retries=1)
    state = json.loads((path / "state.json").read_text())
    assert (state["step"], state["sampling_versions"], state["dropped_stale_rows"],
            state["rollout_retries"]) == (3, ["run/v2", "run/v3"], 2, 1)
    assert state["algorithm"] == cfg.algorithm.value and state["ema_updates"] is None
    # what the uninterrupted run sees next
    twin = torch.Generator()
    twin.set_state(gen.get_state())
    saved, gen_next = _state(learner), torch.rand(4, generator=twin)
    feed_next = [_texts(feed, 1), _texts(feed, 2)]
    # the run goes on (or another process starts): weights, generator and feed all move
    _moved(learner, 2)
    torch.rand(7, generator=gen)
    assert any(not torch.equal(saved[k], v) for k, v in _state(learner).items())
    resumed = checkpoints.load()
    assert resumed == Resumed(step=3, dropped_stale_rows=2, rollout_retries=1, inflight=None)
    for key, value in _state(learner).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    assert torch.equal(torch.rand(4, generator=gen), gen_next)
    assert [_texts(feed, 1), _texts(feed, 2)] == feed_next
    # nothing in flight, or in-flight tensors equal to the sampling adapter's: nothing to publish
    assert checkpoints.publish_inflight(None, TRAIN_ADAPTER, 3) is None
    assert checkpoints.publish_inflight(learner.export(OLD_ADAPTER)[0], OLD_ADAPTER, 3) is None


def test_a_changed_config_is_refused_before_anything_is_restored(tmp_path):
    cfg = _config(tmp_path)
    learner, learners, feed, gen = _objects(cfg)
    Checkpoints(tmp_path / "run", cfg, learners, None, feed, None, gen).save(1, ["run/v1"], 0, 0)
    _moved(learner, 3)
    after, gen_state = _state(learner), gen.get_state()
    changed = _config(tmp_path, optimizer={"lr": cfg.optimizer.lr * 10})
    with pytest.raises(ConfigError) as e:
        Checkpoints(tmp_path / "run", changed, learners, None, feed, None, gen).load()
    assert e.value.expected == {"optimizer.lr": cfg.optimizer.lr}
    assert e.value.actual == {"optimizer.lr": cfg.optimizer.lr * 10}
    for key, value in _state(learner).items():
        assert torch.equal(value, after[key]), key
    assert torch.equal(gen.get_state(), gen_state)
