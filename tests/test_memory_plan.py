"""The memory plan (bench/memory_plan.py) at tiny size against the bytes the processes really
hold: the tiny SD3 checkpoint's modules built on the meta device from its configs, against the
same modules loaded with weights -- text encoders (the encoder stage), transformer (the rollout
replica), VAE (the decoder) -- and a LoRA learner after one optimizer step (parameters,
gradients, AdamW state), each within 10 %."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.memory_plan import Settings, plan_memory
from contract import PolicyKind
from tests.checkpoints import tiny_checkpoint  # noqa: F401 - fixture
from trainer.learner_worker import parameter_bytes


def _settings(**over) -> Settings:
    base = Settings(encoder_dtype="float32", rollout_dtype="float32", decoder_dtype="float32",
                    learner_dtype="float32", fine_tune=PolicyKind.LORA, lora_rank=4, workers=1,
                    micro_batch_size=2, gradient_checkpointing=False, max_batch_rows=2,
                    guidance_scale=1.0, height=32, width=32, num_frames=None, task=None, etp=1)
    return dataclasses.replace(base, **over)


def _close(planned: int, measured: int) -> None:
    assert measured > 0
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)


def _process(plan, prefix: str):
    return next(p for p in plan.processes if p.process.startswith(prefix))


def test_plan_at_tiny_size_matches_the_bytes_the_processes_hold(tiny_checkpoint):
    from adapters.registry import get_family
    from deployments.config import load_graph_config
    from trainer.config import LoRATrainConfig, OptimizerConfig
    from trainer.learner import Learner
    from trainer.learner_config import LearnerConfig
    torch.manual_seed(0)
    root = tiny_checkpoint("sd3")
    graph = load_graph_config({"app_name": "plan_tiny", "rollout": {
        "adapter": "sd3", "weights_path": str(root),
        "adapter_options": {"max_sequence_length": 32}}})
    settings = _settings()
    plan = plan_memory("tiny-sd3", settings, graph, workers=(1,), etps=(1, 2),
                       root_override=root)
    family = get_family("sd3", str(root), {"max_sequence_length": 32})
    encoders = sum(parameter_bytes(family.load_encoders()).values())
    _close(_process(plan, "encoder shard (etp=1)").parameters, encoders)
    assert _process(plan, "encoder shard (etp=2)").parameters < encoders     # split by ETP
    _close(_process(plan, "rollout replica").parameters,
           sum(parameter_bytes(family.load_transformers()).values()))
    _close(_process(plan, "decoder").parameters,
           sum(parameter_bytes(family.load_decoder("image_latent")).values()))
    # a LoRA learner after one optimizer step
    learner = Learner.load(family, LoRATrainConfig(rank=4, alpha=8), OptimizerConfig(lr=1e-3),
                           0, LearnerConfig(), text_encoders=False, media_encoders=False)
    for p in learner.params:
        p.grad = torch.ones_like(p)
    learner.optimizer.step()
    state = [t for s in learner.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]
    worker = _process(plan, "learner worker (DDP")
    _close(worker.parameters, sum(parameter_bytes(learner.models).values()))
    _close(worker.gradients, sum(p.grad.numel() * p.grad.element_size() for p in learner.params))
    _close(worker.optimizer, sum(t.numel() * t.element_size() for t in state))
    assert _process(plan, "controller").parameters == 0


def test_plan_of_full_fine_tuning_shards_over_the_workers(tiny_checkpoint):
    from deployments.config import load_graph_config
    root = tiny_checkpoint("sd3")
    graph = load_graph_config({"app_name": "plan_tiny", "rollout": {
        "adapter": "sd3", "weights_path": str(root),
        "adapter_options": {"max_sequence_length": 32}}})
    plan = plan_memory("tiny-sd3", _settings(), graph, workers=(1, 4), root_override=root)
    one, four = [p for p in plan.processes if p.process.startswith("learner worker (FSDP2")]
    assert one.optimizer == pytest.approx(4 * four.optimizer, rel=1e-6)
    assert one.gradients == pytest.approx(4 * four.gradients, rel=1e-6)
    # fp32 masters + bf16-or-fp32 old / reference copies, AdamW's two fp32 moments
    assert one.optimizer == 2 * one.gradients
