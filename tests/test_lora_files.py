"""LoRA files diffusers' load_lora_weights reads: the project's LoRA on the tiny SD3 checkpoint,
written, loaded by the real StableDiffusion3Pipeline, and read back as an initial policy."""
from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from adapters.lora_files import load_diffusers_lora, save_diffusers_lora
from adapters.registry import get_family
from contract import LoRAMapError, RolloutRequest, Task
from diffusion.noise import initial_noise
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from tests.family_conformance import PROMPTS
from tests.lora_utils import random_lora

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint):
    root = tiny_checkpoint("sd3")
    return root, get_family("sd3", root, {"max_sequence_length": 32})


def test_round_trip_through_diffusers(sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from tests.test_families_image import TestSD3
    root, family = sd3
    tensors, _ = random_lora(family, rank=4, seed=3, std=0.1)
    scale = 0.5
    path = save_diffusers_lora(family, tensors, scale, 4, tmp_path)
    again, again_scale = load_diffusers_lora(family, path)
    assert again_scale == pytest.approx(scale)
    assert set(again) == set(tensors)
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)

    case = TestSD3()
    case.guidance_scale = 1.0
    sampling = case.sampling(seeds=(5,))
    engine = EmbeddedEngine(family, family.load_transformers(), {})
    encoders = family.load_encoders()
    try:
        base = case.engine_latents(family, engine, encoders, PROMPTS[0], sampling)
        engine.load_lora("user", again, again_scale)
        bundle = family.conditioner.tokenize([PROMPTS[0]])[0]        # the same request at
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.T2I)   # "user"
        cond = family.conditioner.encode(encoders, [bundle])
        result = engine.submit(EngineRequest(request, cond, None, ("image_latent",), {},
                                             "user")).result(timeout=300)
        ours = result.latents["image_latent"].data
    finally:
        asyncio.run(engine.shutdown())
    pipe = StableDiffusion3Pipeline.from_pretrained(root, local_files_only=True)
    pipe.load_lora_weights(tmp_path, weight_name=path.name)
    x0 = initial_noise(sampling.seeds, family.codec.state_shape(sampling))
    theirs = pipe(prompt=[PROMPTS[0]], latents=x0, num_inference_steps=sampling.num_steps,
                  guidance_scale=1.0, output_type="latent", max_sequence_length=32,
                  height=sampling.height, width=sampling.width).images
    assert float((ours - theirs).abs().max()) <= 1e-4
    assert float((ours - base["image_latent"]).abs().max()) > 1e-3     # the LoRA acts


def test_foreign_or_untargeted_loras_fail_at_load(sd3, tmp_path):
    _, family = sd3
    tensors, _ = random_lora(family, rank=2, seed=1)
    key = next(iter(tensors))
    bad = {k.replace("attn.to_q", "attn.norm_q"): v for k, v in tensors.items()}
    with pytest.raises(LoRAMapError) as err:
        save_diffusers_lora(family, bad, 1.0, 2, tmp_path / "bad")
    assert "norm_q" in str(err.value.actual) or "norm_q" in err.value.field
    text = {f"text_encoder.{key}": tensors[key].clone(), f"transformer.{key}": tensors[key]}
    save_file(text, str(tmp_path / "te.safetensors"))
    with pytest.raises(LoRAMapError) as err:
        load_diffusers_lora(family, tmp_path / "te.safetensors")
    assert err.value.field == "lora.init_from"


def test_a_users_lora_is_the_initial_policy(sd3, tmp_path):
    from contract import ConfigError
    from trainer.config import OptimizerConfig
    from trainer.learner import Learner
    from trainer.lora import OLD_ADAPTER, LoRATrainConfig
    _, family = sd3
    tensors, _ = random_lora(family, rank=4, seed=7)
    path = save_diffusers_lora(family, tensors, 0.5, 4, tmp_path)
    lora = LoRATrainConfig(rank=4, alpha=2.0, init_from=str(path))
    learner = Learner(family, family.load_transformers(), {}, lora, OptimizerConfig())
    for adapter in ("default", OLD_ADAPTER):
        exported, scale = learner.export(adapter)
        assert scale == 0.5 and all(torch.equal(exported[k], tensors[k]) for k in tensors)
    with pytest.raises(ConfigError) as err:
        Learner(family, family.load_transformers(), {}, lora.model_copy(update={"rank": 8}),
                OptimizerConfig())
    assert err.value.field == "lora.rank"
