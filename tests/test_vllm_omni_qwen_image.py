"""Qwen-Image through the vLLM-Omni engine (the fake AsyncOmni, the real RolloutPipeline and
lowering): its masked condition (long `prompt_mask`), its per-request `img_shapes` input and the
norm-rescaled CFG survive the lowering, so the tiny checkpoint samples what the embedded engine
samples; its folder's class is one vLLM-Omni registers (QwenImagePipeline, checked against the
wheel by tests/test_vllm_omni_wheel_contract.py)."""
from __future__ import annotations

import asyncio

import torch

from contract import RolloutRequest, SamplingSpec, Task
from rollout.engine_api import EngineRequest
from rollout.vllm_omni.engine import VllmOmniEngine, check_architecture
from testing.vllm_omni_fake import fake_api

torch.set_num_threads(1)
OPTIONS = {"max_sequence_length": 32}


def test_qwen_image_runs_the_same_guided_step_under_vllm_omni(tiny_checkpoint, tmp_path):
    from adapters.registry import get_family
    from rollout.engine import EmbeddedEngine
    root = str(tiny_checkpoint("qwen_image"))
    family = get_family("qwen_image", root, OPTIONS)
    check_architecture(family)                       # QwenImagePipeline: served
    encoders = family.load_encoders()
    bundle = family.conditioner.tokenize(["a red circle"], [" "])[0]
    sampling = SamplingSpec(num_steps=3, seeds=(1, 2), height=32, width=48, guidance_scale=4.0)
    request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.T2I)
    cond = family.conditioner.encode(encoders, [bundle])
    negative = family.conditioner.encode(encoders, [bundle.negative])
    lowered = EngineRequest(request=request, cond=cond, negative=negative,
                            latent_artifacts=("image_latent",), media={},
                            policy_version="base")
    vllm = VllmOmniEngine.create("qwen_image", root, api=fake_api(), dtype=torch.float32,
                                 lora_root=str(tmp_path / "loras"))
    embedded = EmbeddedEngine(family, family.load_transformers(), {})
    try:
        a = asyncio.run(vllm.generate(lowered))
        b = asyncio.run(embedded.generate(lowered))
    finally:
        asyncio.run(vllm.shutdown())
        asyncio.run(embedded.shutdown())
    assert a.trajectory.guidance_scale == b.trajectory.guidance_scale == 4.0
    assert (a.latents["image_latent"].data - b.latents["image_latent"].data).abs().max() <= 1e-5
    assert (a.trajectory.log_probs - b.trajectory.log_probs).abs().max() <= 1e-5
