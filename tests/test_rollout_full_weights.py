"""Full-weight versions on the embedded engine (a full fine-tune's publications): a version
samples exactly what a model holding those weights samples, the base weights and LoRA
versions keep serving beside it, one full version is resident (the least recently used
unpinned one is evicted; a load waits for a pinned one's requests), and a version that does
not cover the model is a typed error naming the tensor."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import LoRAMapError, PolicyVersionError, SamplerKind
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from trainer.config import PromptSource, SamplerSettings
from trainer.prompts import captions, make_requests


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    model = family.load_transformers()["transformer"]
    engine = EmbeddedEngine(family, {"transformer": copy.deepcopy(model)}, {})
    encoder = family.load_encoders()
    yield family, model, engine, encoder
    asyncio.run(engine.shutdown())


def _weights(model, seed: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(seed))
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters()}


def _lora(family, model, rank: int = 2) -> dict[str, torch.Tensor]:
    """Random LoRA tensors (training-form names) on every declared target."""
    gen = torch.Generator().manual_seed(9)
    out = {}
    for name, module in model.named_modules():
        if any(name.endswith(t) for t in family.spec.lora_targets["transformer"]):
            out[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen)
            out[f"{name}.lora_B.weight"] = 0.05 * torch.randn(module.out_features, rank,
                                                              generator=gen)
    return out


def _sample(family, engine, encoder, version: str) -> torch.Tensor:
    prompts = family.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 1))
    requests = make_requests(family, prompts, SamplerSettings(num_steps=3), 2, 5, version,
                             sampler=SamplerKind.ODE)
    cond = family.conditioner.encode(encoder, prompts)

    async def go():
        return [await engine.generate(EngineRequest(r, cond.index_select(torch.tensor([i])),
                                                    None, ("image_latent",), {}, version))
                for i, r in enumerate(requests)]
    return torch.cat([e.latents["image_latent"].data for e in asyncio.run(go())])


def test_a_full_version_samples_as_a_model_holding_its_weights(setup):
    family, model, engine, encoder = setup
    base = _sample(family, engine, encoder, "base")
    weights = _weights(model, 1)
    engine.load_full("full-1", weights)
    held = copy.deepcopy(model)
    held.load_state_dict(weights, strict=False)
    reference = EmbeddedEngine(family, {"transformer": held}, {})
    try:
        want = _sample(family, reference, encoder, "base")
    finally:
        asyncio.run(reference.shutdown())
    engine.load_lora("lora-1", _lora(family, model))
    with_lora = _sample(family, engine, encoder, "lora-1")
    got = _sample(family, engine, encoder, "full-1")
    assert torch.equal(got, want) and not torch.allclose(got, base)
    assert torch.equal(_sample(family, engine, encoder, "base"), base)   # base restored
    assert torch.equal(_sample(family, engine, encoder, "lora-1"), with_lora)
    assert not torch.allclose(with_lora, base)
    engine.load_full("full-2", _weights(model, 2))                      # evicts full-1
    assert "full-1" not in engine.versions() and "full-2" in engine.versions()
    assert engine.latest_version() == "full-2"


def test_a_version_that_does_not_cover_the_model_is_refused(setup):
    family, model, engine, _ = setup
    weights = _weights(model, 3)
    name = next(iter(weights))
    partial = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(LoRAMapError) as e:
        engine.load_full("partial", partial)
    assert e.value.field == f"weights[{name}]"
    wrong = dict(weights)
    wrong[name] = torch.zeros(3)
    with pytest.raises(LoRAMapError) as e:
        engine.load_full("wrong", wrong)
    assert e.value.field == f"weights[{name}]" and e.value.actual == (3,)
    with pytest.raises(PolicyVersionError):
        engine.load_full("base", weights)
