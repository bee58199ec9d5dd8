"""trainer/evaluation.py in process (no Ray): Evaluation built from the objects it reads, with the
real embedded engine as its rollout, asks for the held-out prompts with ODE, the evaluation's
steps, seeds and group, and the version it is given, and averages the rewards per scorer over
the present scores. The gallery and W&B media of a real run: tests/test_trainer_resume.py."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import RewardReport, RolloutOutput, SamplerKind, ScorerOutput, ScoreStatus
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from trainer.config import TrainerConfig
from trainer.evaluation import Evaluation
from trainer.learner import Learner
from trainer.run_state import PromptFeed


def _scored(request, result) -> RolloutOutput:
    """Two scorers of the real samples: `level` (mean and max of the latent), `spread` (its std,
    missing for the first row)."""
    x = result.latents["image_latent"].data.float()
    level = {"mean": tuple(x.mean(dim=(1, 2, 3)).tolist()),
             "max": tuple(x.amax(dim=(1, 2, 3)).tolist())}
    spread = (None,) + tuple(x.std(dim=(1, 2, 3)).tolist()[1:])
    n = x.shape[0]
    by_scorer = {
        "level": ScorerOutput("level", level, (ScoreStatus.OK,) * n, (None,) * n),
        "spread": ScorerOutput("spread", {"std": spread},
                               (ScoreStatus.MISSING,) + (ScoreStatus.OK,) * (n - 1),
                               ("no spread",) + (None,) * (n - 1))}
    total = tuple(m - 0.1 * (s or 0.0) for m, s in zip(level["mean"], spread))
    return RolloutOutput(request.request_id, dict(result.latents), result.trajectory,
                         result.policy_version, request.sampling.seeds,
                         rewards=RewardReport(by_scorer, total, {"level": 1.0, "spread": 0.1}))


def test_evaluate_requests_the_held_out_prompts_and_averages_the_present_scores(tmp_path):
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    cfg = TrainerConfig(eval={"num_prompts": 2, "samples_per_prompt": 3, "num_steps": 3,
                              "seed": 77}, run_dir=str(tmp_path))
    transformers = family.load_transformers()
    engine = EmbeddedEngine(family, copy.deepcopy(transformers), {})     # before peft wraps them
    learner = Learner(family, transformers, family.load_encoders(), cfg.lora, cfg.optimizer)
    tensors, scale = learner.export()
    engine.load_lora("run/ema-4", tensors, scale)
    feed = PromptFeed(cfg, family.conditioner.tokenize)
    asked, outputs = [], []

    def rollout(requests):
        async def go():
            return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                        ("image_latent",), {},
                                                        r.policy_version))
                    for r, p in zip(requests, feed.eval_bundles)]
        asked.extend(requests)
        outputs.extend(_scored(r, e) for r, e in zip(requests, asyncio.run(go())))
        return outputs

    evaluation = Evaluation(cfg.eval, cfg.sampler, cfg.task, family, feed, rollout, tmp_path,
                            gallery=False, wandb=None, media_every=1)
    try:
        metrics = evaluation.evaluate(4, "run/ema-4")
    finally:
        asyncio.run(engine.shutdown())
    assert len(asked) == 2
    for i, r in enumerate(asked):
        assert r.prompt.token_ids == feed.eval_bundles[i].token_ids
        assert r.policy_version == "run/ema-4" and r.sampling.sampler is SamplerKind.ODE
        assert r.sampling.num_steps == 3 and r.sampling.seeds == tuple(77 + i * 3 + j
                                                                       for j in range(3))
    totals = [t for o in outputs for t in o.rewards.total]
    means = [v for o in outputs for v in o.rewards.by_scorer["level"].scores["mean"]]
    maxes = [v for o in outputs for v in o.rewards.by_scorer["level"].scores["max"]]
    stds = [v for o in outputs for v in o.rewards.by_scorer["spread"].scores["std"]]
    assert len(totals) == 6 and stds.count(None) == 2
    present = [v for v in stds if v is not None]
    assert metrics["eval_reward_mean"] == pytest.approx(sum(totals) / 6)
    assert metrics["eval_level/mean_mean"] == pytest.approx(sum(means) / 6)
    assert metrics["eval_level/max_mean"] == pytest.approx(sum(maxes) / 6)
    assert metrics["eval_spread/std_mean"] == pytest.approx(sum(present) / 4)
    assert metrics["eval_s"] > 0
    assert evaluation.evaluations == 0 and not (tmp_path / "gallery").exists()   # no gallery
