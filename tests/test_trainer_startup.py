"""The trainer's start-up checks object (trainer/startup.py StartupChecks) in process on the
embedded tiny text-to-image family (no Ray): its time-convention check reports what
trainer/checks.py computes on the same clean latents, a flipped declaration fails it
(StartupCheckError naming adapter.time_convention), the config's switches decide what runs, and
an edit run without held-out source images is a ConfigError naming data.test. The LoRA map check
through the graph, and the checks through a Trainer: tests/test_trainer_graph.py (integration)."""
from __future__ import annotations

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import ConfigError, StartupCheckError, Task, TimeConvention
from trainer import checks
from trainer.config import ChecksConfig, PromptSource, SamplerSettings, TrainerConfig
from trainer.distributed import Colocation, LocalLearners
from trainer.learner import Learner
from trainer.prompts import probe_clean_latents
from trainer.rollout_batch import StageConditions
from trainer.run_state import PromptFeed
from trainer.startup import StartupChecks, held_out_media


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    cfg = TrainerConfig(samples_per_prompt=2, prompts_per_step=2,
                        sampler=SamplerSettings(num_steps=4, window=(0, 2)))
    learner = Learner(family, family.load_transformers(), family.load_encoders(), cfg.lora,
                      cfg.optimizer)
    return family, cfg, learner, PromptFeed(cfg, family.conditioner.tokenize)


def startup_checks(setup, **config) -> StartupChecks:
    """The object as the Trainer builds it, the learner here encoding the prompts itself
    (conditions=None) and no graph: the LoRA map check is switched off."""
    family, cfg, learner, feed = setup
    return StartupChecks(ChecksConfig(lora_map=False, **config), cfg.sampler, cfg.task,
                         cfg.prompts, cfg.seed, family, feed,
                         LocalLearners(cfg, learner, Colocation(None)), publisher=None,
                         rollout=None, stage_conditions=StageConditions(family, {}),
                         conditions=None)


def test_time_convention_through_the_object_and_a_flip_fails_it(setup, monkeypatch):
    family, _, learner, _ = setup
    report = startup_checks(setup).run()
    x0, prompts = probe_clean_latents(PromptSource.SHAPES, family)
    assert report == checks.check_time_convention(learner, x0, prompts)
    assert sorted(report) == sorted(f"cos_{c}@{s}" for c in ("declared", "other")
                                    for s in checks.PROBE_SIGMAS)
    assert all(report[f"cos_declared@{s}"] > max(0.3, report[f"cos_other@{s}"])
               for s in checks.PROBE_SIGMAS)
    assert startup_checks(setup, time_convention=False).run() == {}

    declared = TimeConvention(family.denoiser.time_convention)
    flipped = next(c for c in TimeConvention if c != declared)
    monkeypatch.setattr(family.denoiser, "time_convention", flipped)
    with pytest.raises(StartupCheckError) as err:
        startup_checks(setup).run()
    assert err.value.field == "adapter.time_convention"
    assert err.value.actual == flipped.value


def test_edit_checks_need_held_out_sources(setup):
    """An edit's checks run on the held-out records' sources: a feed without them (the synthetic
    prompts) is refused before any work, naming data.test; a text task needs none."""
    _, _, _, feed = setup
    assert held_out_media(feed, None, 2) == (None, None)
    assert held_out_media(feed, Task.T2I, 2) == (None, None)
    with pytest.raises(ConfigError) as err:
        held_out_media(feed, Task.EDIT, 2)
    assert err.value.field == "data.test" and err.value.actual == 0
