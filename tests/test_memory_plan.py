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


# ---- activations: the estimate against the live bytes of real forwards ----------------------

class LiveBytes:
    """Bytes of the tensors created inside the context that are still alive, and their peak:
    every op's outputs are recorded by storage (torch's dispatch mode) and dropped when the
    storage is freed; tensors made before entering (inputs, weights) and views of an op's
    inputs (a weight's transpose) are not counted."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.sweep()
                inputs = {t.untyped_storage()._cdata
                          for t in torch.utils._pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        s = t.untyped_storage()
                        if s._cdata not in tracker.live and s._cdata not in inputs:
                            tracker.live[s._cdata] = (StorageWeakRef(s), s.nbytes())
                            tracker.now += s.nbytes()
                tracker.peak = max(tracker.peak, tracker.now)
                return out

        self.live: dict[int, tuple] = {}
        self.now = self.peak = 0
        self.mode = Mode()

    def sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.sweep()
        return self.mode.__exit__(*exc)


def _minimax_block(heads: int, seed: int = 0):
    """One real MiniMax-H3 block at an eighth of its widths (hidden 672, ffn 1792, time
    embedding 336: the model's ratios) with `heads` heads of 128."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    torch.manual_seed(seed)
    return MiniMaxH3TransformerBlock(672, heads, 128, 1792, 336, 1e-5, 1e-5)


def _block_inputs(tokens: int, grad: bool):
    x = torch.randn(1, tokens, 672, dtype=torch.bfloat16, requires_grad=grad)
    return x, torch.randn(2, 336), torch.zeros(tokens, dtype=torch.long), \
        (torch.randn(tokens, 96), torch.randn(tokens, 96))


@pytest.mark.parametrize("heads", [7, 14])       # the model's attention width / hidden, and 2x
def test_block_activation_factors_match_the_real_blocks_live_bytes(heads):
    """The planner's per-block factors (bench/memory_plan.inference_factor / training_factor,
    from the block's counted widths) against the bytes a real MiniMax-H3 block holds in bf16:
    in inference the peak of its live tensors (+ its input, which the caller holds), in
    training what it keeps for backward after its forward -- with LoRA on the family's targets
    (frozen base weights) and with every weight trained -- and, checkpointed (LoRA), what it
    keeps (its output: the next block's input) and the peak of its recompute + backward, each
    within 10 %."""
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.checkpoint import checkpoint

    from adapters.minimax_h3 import MINIMAX_H3_LORA_TARGETS
    from bench.memory_plan import (ModuleCount, inference_factor, recompute_factor,
                                   training_factor)
    tokens = 1024
    count = ModuleCount.of(_minimax_block(heads))
    assert (count.hidden, count.ffn, count.up, count.attention) == \
        (672, 1792, 2 * 1792, heads * 128)
    unit = tokens * 672 * 2                                   # tokens x hidden x bf16 bytes
    block = _minimax_block(heads).to(torch.bfloat16)
    x, temb, idx, rope = _block_inputs(tokens, grad=False)
    with torch.inference_mode(), LiveBytes() as live:
        block(x, temb, idx, rope)
    _close(int(inference_factor(count) * unit), live.peak + x.nbytes)

    def trained(lora: bool):
        block = _minimax_block(heads)
        if lora:
            block.requires_grad_(False)
            inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16,
                                               target_modules=list(MINIMAX_H3_LORA_TARGETS)),
                                    block)
        return block.to(torch.bfloat16)

    for lora in (True, False):
        block = trained(lora)
        x, temb, idx, rope = _block_inputs(tokens, grad=True)
        with LiveBytes() as live:
            y = block(x, temb, idx, rope)
            live.sweep()
            kept = live.now - y.nbytes                        # what backward will read
        _close(int(training_factor(count, lora) * unit), kept)
    block = trained(True)
    x, temb, idx, rope = _block_inputs(tokens, grad=True)
    with LiveBytes() as live:
        y = checkpoint(block, x, temb, idx, rope, use_reentrant=False)
        live.sweep()
        assert live.now == y.nbytes                           # nothing kept but the output
        y.float().pow(2).mean().backward()
    _close(int(recompute_factor(count, True) * unit), live.peak)


def test_minimax_h3_rollout_runs_one_row_per_transformer_call(tiny_checkpoint):
    """The MiniMax-H3 denoiser declares rows_per_call 1, and a forward of 4 rows peaks at the
    live bytes of a forward of one plus little (the earlier rows' outputs: each row's packed
    sequence runs alone; 4 rows in one call would hold 4 rows' block tensors at once), so the planner sizes the rollout replica's activations by one row at any
    max_batch_rows: the same activations at 8 rows as at 1."""
    from adapters.minimax_h3 import LAYOUT, TEXT_TAG, MiniMaxH3Family
    from adapters.sample import LocalModels
    from contract import SamplerKind, SamplingSpec
    root = tiny_checkpoint("minimax_h3")
    family = MiniMaxH3Family(root)
    assert family.denoiser.rows_per_call == 1
    models = LocalModels.load(family).transformers
    sampling = SamplingSpec(sampler=SamplerKind.ODE, noise_level=0.0, num_steps=3,
                            guidance_scale=1.0, seeds=(0,), height=64, width=128,
                            num_frames=124)
    layout = family.codec.layout(sampling)
    width = models["transformer"].config.text_dim
    peaks = {}
    for rows in (1, 4):
        torch.manual_seed(0)
        cond = family.conditioner.rows([torch.randn(1, 16, width)] * rows,
                                       [torch.full((16,), TEXT_TAG)] * rows)
        state = torch.randn(rows, layout.size)
        sigma = family.sigmas(sampling)[:1].repeat(rows)
        media = {LAYOUT: layout.encoded().repeat(rows, 1)}
        with torch.inference_mode(), LiveBytes() as live:
            out = family.denoiser.forward(models, state, sigma, sigma, cond, media, None)
        peaks[rows] = live.peak - out.nbytes
    assert peaks[4] < 1.5 * peaks[1], peaks
    settings = dict(rollout_dtype="bfloat16", task=None, height=64, width=128,
                    num_frames=124)
    graph = _minimax_graph(root)
    one, eight = (_process(plan_memory("tiny-minimax-h3", _settings(**settings,
                                                                      max_batch_rows=n),
                                       graph, workers=(1,), etps=(1,), root_override=root),
                           "rollout replica") for n in (1, 8))
    assert one.activations == eight.activations > 0


def _minimax_graph(root):
    from deployments.config import load_graph_config
    return load_graph_config({"app_name": "plan_tiny", "rollout": {
        "adapter": "minimax_h3", "weights_path": str(root)}})


# ---- the MiniMax-H3 GPU recipe through the planner ---------------------------------------------

MINIMAX_RECIPE = "configs/train_minimax_h3_gpu.yaml"      # graph: configs/gpu_minimax_h3.yaml


def test_minimax_h3_gpu_recipe_fits_its_gpus():
    """configs/train_minimax_h3_gpu.yaml + configs/gpu_minimax_h3.yaml through the planner at
    the recipe's own size (288 x 448 x 124; its rollout.architecture is minimax-h3): every GPU
    process -- encoder shard at ETP 4, rollout replica, both
    decoders, the LoRA learner worker -- within its share (num_gpus x the card its stage's
    labels pin) of the card; the shares are the config's own, checked here independently."""
    from pathlib import Path

    from bench.memory_plan import GPUS, Settings, config_fit
    from trainer.config import load_trainer_config
    rows = config_fit(Path(MINIMAX_RECIPE), "minimax-h3")
    names = [r["process"] for r in rows]
    assert names == ["encoder shard (etp=4)", "rollout replica", "decoder audio_latent",
                     "decoder video_latent", "learner worker (DDP, LoRA r32, any N)"]
    assert all(r["fits"] for r in rows), rows
    cfg = load_trainer_config(MINIMAX_RECIPE)
    graph = cfg.graph_config()
    share = dict(zip(names, [graph.encoder.num_gpus_per_shard, graph.rollout_stage.num_gpus,
                             graph.decoder.num_gpus, graph.decoder.num_gpus,
                             cfg.learner.resources_per_worker["GPU"]]))
    for r in rows:
        assert r["share"] in {share[r["process"]] * g for g in GPUS.values()}
        assert 0 < r["total"] <= r["share"]
    settings, _ = Settings.from_config(Path(MINIMAX_RECIPE))
    assert (settings.height, settings.width, settings.num_frames) == (288, 448, 124)
    assert graph.rollout.architecture == "minimax-h3"


def test_architecture_named_on_the_command_line_takes_the_configs_size(capsys, tmp_path):
    """`--memory <a config naming no description> --architecture minimax-h3` plans at the
    config's sampler size (the description is the config's adapter's family), another
    family's description at its own defaults: the recipe with `rollout.architecture` left out."""
    from pathlib import Path

    from bench.memory_plan import main, own_architecture
    from trainer.config import load_trainer_config
    graph_text = Path("configs/gpu_minimax_h3.yaml").read_text()
    line = next(x for x in graph_text.splitlines(keepends=True) if "architecture: minimax-h3" in x)
    (tmp_path / "graph.yaml").write_text(graph_text.replace(line, ""))
    recipe = tmp_path / "train.yaml"
    recipe.write_text(Path(MINIMAX_RECIPE).read_text().replace(
        "graph: configs/gpu_minimax_h3.yaml", f"graph: {tmp_path / 'graph.yaml'}"))
    graph = load_trainer_config(recipe).graph_config()
    assert graph.rollout.architecture is None
    assert own_architecture("minimax-h3", graph) and not own_architecture("ltx-2", graph)
    main(["--memory", str(recipe), "--architecture", "minimax-h3", "--etp", "4",
          "--workers", "2"])
    out = capsys.readouterr().out
    assert "minimax-h3 (the config: {'height': 288, 'width': 448, 'num_frames': 124}" in out
    assert "DOES NOT FIT" not in out and "rollout replica: " in out


@pytest.mark.parametrize("anchors", [(), ("first",), ("first", "last")])
def test_minimax_h3_tokens_are_the_packed_sequences_rows(tiny_checkpoint, anchors):
    """The planner's tokens per row for MiniMax-H3 (its denoiser's sequence_tokens, by the
    task's keyframes) equal the length of the packed sequence diffusers' layout step builds for
    the same size, text length and keyframe anchors (T2VA, I2VA, FL2VA)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    from adapters.minimax_h3 import (AUDIO_CHANNELS, AUDIO_TAG, TEXT_TAG, VIDEO_TAG,
                                     MiniMaxH3Family)
    from contract import SamplerKind, SamplingSpec
    family = MiniMaxH3Family(tiny_checkpoint("minimax_h3"))
    sampling = SamplingSpec(sampler=SamplerKind.ODE, noise_level=0.0, num_steps=3,
                            guidance_scale=1.0, seeds=(0,), height=64, width=128,
                            num_frames=124)
    layout = family.codec.layout(sampling)
    position_ids, *_ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((40,), TEXT_TAG), layout.frames, layout.rows, layout.cols, layout.audio,
        layout.dims.patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, anchors)
    assert family.denoiser.sequence_tokens(sampling, 40, len(anchors)) == position_ids.shape[0]
