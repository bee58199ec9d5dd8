"""The memory plan (bench/memory_plan.py) at tiny size against the bytes the processes really
hold: the tiny SD3 checkpoint's modules built on the meta device from its configs, against the
same modules loaded with weights -- text encoders (the encoder stage), transformer (the rollout
replica), VAE (the decoder) -- and a LoRA learner after one optimizer step (parameters,
gradients, AdamW state), each within 10 %. At real sizes, every shipped description: the
planner's parameter counts and MLP widths against the classes its model_index.json names."""
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


def _real_module(root, component: str):
    """The class model_index.json names, built on the meta device from the component's config
    with the library's own constructor (not the planner's builder)."""
    import importlib
    import json

    import diffusers.pipelines
    library, name = json.loads((root / "model_index.json").read_text())[component]
    module = importlib.import_module(library) if library in ("diffusers", "transformers") \
        else getattr(diffusers.pipelines, library)
    cls = getattr(module, name)
    with torch.device("meta"):
        if library == "transformers":
            return cls(cls.config_class.from_pretrained(root / component))
        return cls.from_config(cls.load_config(root / component))


def _declared_mlp_width(module) -> int:
    """The MLP width the config declares: ffn_dim (Wan, MiniMax-H3), intermediate_size / d_ff
    (the text encoders, on their text config), else diffusers' FeedForward default of
    4 x the attention width (SD3, FLUX, Qwen-Image, LTX-2's video stream)."""
    config = module.config
    config = getattr(config, "text_config", None) or config
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return get("ffn_dim") or get("intermediate_size") or get("d_ff") or \
        4 * get("num_attention_heads") * get("attention_head_dim")


@pytest.mark.parametrize("architecture", ["sd3.5-medium", "sd3.5-large", "flux.1-dev",
                                          "wan2.1-t2v-14b", "wan2.2-t2v-a14b", "ltx-2",
                                          "qwen-image", "minimax-h3"])
def test_plan_counts_the_real_classes_parameters_and_mlp_widths(architecture):
    """Every shipped description: the planner's parameter count of each component equals
    sum(p.numel()) of the class model_index.json names, built on the meta device; the MLP
    width it sizes activations by is the one the config declares (MiniMax-H3: ffn_dim 14336,
    not its attention width 56 x 128 = 7168)."""
    from adapters.architectures import architecture_root
    plan = plan_memory(architecture, _settings(height=None, width=None), None, workers=(2,),
                       etps=(1,))
    root = architecture_root(architecture)
    assert plan.components
    for component, count in plan.components.items():
        real = _real_module(root, component)
        assert count["params"] == sum(p.numel() for p in real.parameters()), component
        if "transformer" in component or "text_encoder" in component:
            assert count["ffn"] == _declared_mlp_width(real), (component, count)
