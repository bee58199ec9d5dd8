"""The engine on REAL vLLM-Omni 0.30.0 (GPU machines; run by scripts/gpu_check_vllm_omni.sh)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm_omni")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from adapters.tiny_t2i import TinyT2IFamily
    from rollout.vllm_omni.engine import VllmOmniEngine

    family = TinyT2IFamily()
    path = tmp_path_factory.mktemp("tiny_t2i_model")
    family.save(family.build(seed=0), path)
    # vLLM-Omni resolves a model directory through model_index.json (_class_name).
    (path / "model_index.json").write_text(json.dumps({"_class_name": "RolloutPipeline"}))
    eng = VllmOmniEngine.create("tiny_t2i", str(path), dtype=torch.float32,
                                lora_root=str(tmp_path_factory.mktemp("loras")))
    yield eng
    asyncio.run(eng.shutdown())


def _req(seeds=(1, 2), version="base"):
    from tests.test_vllm_omni_engine import make_request
    from adapters.tiny_t2i import TinyT2IFamily
    family = TinyT2IFamily()
    components = {"encoders": family.load_encoders()}
    return make_request((family, components, None), seeds=seeds, version=version)


def test_generate_lora_switch_sleep_wake(engine):
    loop = asyncio.new_event_loop()
    base = loop.run_until_complete(engine.generate(_req()))
    t = base.trajectory
    assert t.latents.shape[:2] == (2, 3) and t.log_probs.shape == (2, 2)
    assert torch.isfinite(t.log_probs).all()
    print("PASS generate", tuple(base.latents["image_latent"].data.shape))
    again = loop.run_until_complete(engine.generate(_req()))
    assert torch.allclose(again.latents["image_latent"].data, base.latents["image_latent"].data,
                          atol=1e-4)
    module = "transformer_blocks.0.attn.to_q"
    g = torch.Generator().manual_seed(0)
    tensors = {f"{module}.lora_A.weight": torch.randn(2, 96, generator=g),
               f"{module}.lora_B.weight": torch.randn(96, 2, generator=g)}
    engine.load_lora("v1", tensors)
    v1 = loop.run_until_complete(engine.generate(_req(version="v1")))
    assert v1.policy_version == "v1"
    assert not torch.allclose(v1.latents["image_latent"].data, base.latents["image_latent"].data)
    print("PASS lora switch id", engine.lora_id("v1"))
    loop.run_until_complete(engine.sleep(level=1))
    loop.run_until_complete(engine.wake_up())
    after = loop.run_until_complete(engine.generate(_req()))
    assert torch.allclose(after.latents["image_latent"].data, base.latents["image_latent"].data,
                          atol=1e-4)
    print("PASS sleep/wake")
