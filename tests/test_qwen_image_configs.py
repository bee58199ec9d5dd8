"""The Qwen-Image FlowGRPO GPU recipe (configs/train_qwen_image_gpu.yaml: OCR reward, 32 prompts x
16 samples) validates here; its tiny twin (configs/train_qwen_image_tiny.yaml) is the same recipe
at toy size and trains FlowGRPO steps in one process on the tiny Qwen-Image checkpoint: the
embedded engine samples with true CFG (the records' negative prompt), the image verifier scores
the decoded images, the learner's log-probs equal the engine's and the adapter moves."""
from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from contract import Algorithm, MediaArtifact, PolicyKind, RewardReport, RolloutOutput, SamplerKind
from trainer.config import REPO_ROOT, load_trainer_config

GPU, TINY = "configs/train_qwen_image_gpu.yaml", "configs/train_qwen_image_tiny.yaml"
# what may differ between the two: sizes, the hardware layout, prompts, the graph, bookkeeping
LAYOUT = ("graph", "data.", "steps", "prompts_per_step", "samples_per_prompt", "sampler.num_steps",
          "sampler.height", "sampler.width", "learner.device", "learner.dtype",
          "learner.workers", "learner.resources_per_worker", "eval.", "wandb.", "run_dir",
          "checkpoint_every")


def _flat(data):
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "graph":
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def test_the_qwen_image_gpu_config_validates_here():
    cfg = load_trainer_config(GPU)
    graph = cfg.graph_config()
    assert graph.rollout.adapter == "qwen_image" and graph.rollout.dtype == "bfloat16"
    assert [s.name for s in graph.scorers] == ["ocr"]
    assert cfg.algorithm is Algorithm.FLOW_GRPO
    assert (cfg.prompts_per_step, cfg.samples_per_prompt) == (32, 16)
    assert cfg.sampler.sampler is SamplerKind.SDE and cfg.sampler.guidance_scale == 4.0
    assert (cfg.lora.rank, cfg.learner.fine_tune) == (64, PolicyKind.LORA)
    assert cfg.prompts_per_step % cfg.learner.workers == 0
    for path in (cfg.data.train, cfg.data.test):      # guided: every record has its negative
        records = [json.loads(line) for line in (REPO_ROOT / path).read_text().splitlines()]
        assert records and all(r["negative_prompt"] == " " and r["metadata"]["ocr_text"]
                               for r in records)


def test_the_tiny_config_is_the_gpu_recipe():
    gpu = _flat(load_trainer_config(GPU).model_dump(mode="json"))
    tiny = _flat(load_trainer_config(TINY).model_dump(mode="json"))
    assert set(gpu) == set(tiny)
    differ = {k for k in gpu if gpu[k] != tiny[k]}
    assert differ and all(k.startswith(LAYOUT) for k in differ), sorted(differ)
    for key in ("algorithm", "lora.rank", "lora.alpha", "optimizer.lr", "flow_grpo.clip_range",
                "sampler.sampler", "sampler.guidance_scale", "sampler.noise_level",
                "advantage.std"):
        assert gpu[key] == tiny[key], key


def test_the_tiny_config_trains_flow_grpo_steps_in_process(tiny_checkpoint):
    from adapters.registry import get_family
    from rewards.base import ScoreRequest
    from rewards.verifiers.image import ImageAttributeScorer
    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from trainer import checks
    from trainer.datasets import load_prompt_file
    from trainer.learner import Learner
    from trainer.prompts import make_requests
    from trainer.rollout_batch import build_batch
    from trainer.updates import UPDATES

    torch.set_num_threads(1)
    cfg = load_trainer_config(TINY)
    rollout = cfg.graph_config().rollout
    family = get_family(rollout.adapter, tiny_checkpoint("qwen_image"), rollout.adapter_options)
    transformers = family.load_transformers()
    engine = EmbeddedEngine(family, copy.deepcopy(transformers), {})
    learner = Learner(family, transformers, family.load_encoders(), cfg.lora, cfg.optimizer)
    decoder = family.load_decoder("image_latent")
    scorer = ImageAttributeScorer()
    image = next(a for a in family.io_spec.artifacts if a.name == "image")
    records = load_prompt_file(REPO_ROOT / cfg.data.train)[:cfg.prompts_per_step]
    bundles = family.conditioner.tokenize([r.text for r in records],
                                          [r.negative for r in records])
    group = cfg.samples_per_prompt
    try:
        moved = []
        for step in range(2):
            version = f"q-v{step}"
            tensors, scale = learner.export()
            engine.load_lora(version, tensors, scale)
            requests = make_requests(family, bundles, cfg.sampler, group, step * 100, version)

            async def generate():
                return [await engine.generate(EngineRequest(
                    r, learner.encode([b]), learner.encode([b.negative]), ("image_latent",),
                    {}, version)) for r, b in zip(requests, bundles)]
            results = asyncio.run(generate())
            outputs = []
            for request, result, record in zip(requests, results, records):
                assert result.trajectory.guidance_scale == 4.0        # guided rollouts
                pixels = family.codec.decode("image_latent", decoder,
                                             result.latents["image_latent"].data,
                                             request.sampling)
                scored = scorer.score(ScoreRequest({"image": MediaArtifact(image, pixels)},
                                                   (record.text,) * group))
                outputs.append(RolloutOutput(
                    request.request_id, dict(result.latents), result.trajectory,
                    result.policy_version, request.sampling.seeds,
                    rewards=RewardReport({}, tuple(scored.scores[scorer.primary]), {})))
            batch = build_batch(learner, bundles, outputs, [r.sampling for r in requests])
            parity = checks.logprob_mismatch(learner, batch.trajectory, batch.cond,
                                             {version: tensors}.__getitem__, batch.versions,
                                             cfg.checks.logprob_ratio_tol, batch.uncond,
                                             batch.inputs)
            print(f"step {step}: rewards {[round(float(r), 3) for r in batch.rewards]}, "
                  f"log-prob ratio error {parity['logprob_ratio_err_max']:.3g}")
            assert parity["logprob_ratio_err_max"] <= 1e-4
            before = [p.detach().clone() for p in learner.params]
            metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg,
                                                   torch.Generator().manual_seed(step))
            assert torch.isfinite(torch.tensor(metrics["loss"]))
            moved.append(any(not torch.equal(a, b) for a, b in zip(before, learner.params)))
        assert any(moved)          # a step whose groups all tie trains nothing (A = 0 dropped)
    finally:
        asyncio.run(engine.shutdown())
