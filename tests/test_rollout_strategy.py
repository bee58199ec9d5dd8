"""Strategy selection and DiffusionStrategy validation/lowering/output."""
from __future__ import annotations

import asyncio

import pytest
import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import (InvalidRequestError, LimitExceededError, MediaInput, MediaRole, Modality,
                      PolicyVersionError, RequestLimits, RolloutRequest, SamplingSpec, Task,
                      UndeclaredArtifactError)
from diffusion.step import doubles_rows
from rollout.config import RolloutConfig, StrategyKind
from rollout.strategy import STRATEGY_BUILDERS, DiffusionStrategy, build_strategy

torch.set_num_threads(1)


def test_every_strategy_kind_has_exactly_one_builder():
    assert set(STRATEGY_BUILDERS) == set(StrategyKind)
    with pytest.raises(ValueError):
        RolloutConfig(strategy="diffusion", unknown_field=1)


@pytest.fixture(scope="module")
def diffusion(tmp_path_factory):
    family = TinyT2IFamily()
    weights = tmp_path_factory.mktemp("tiny_t2i")
    family.save(family.build(seed=0), weights)
    strategy = build_strategy(RolloutConfig(strategy=StrategyKind.DIFFUSION,
                                            weights_path=str(weights)), RequestLimits())
    strategy.encoders = strategy.family.load_encoders()     # the encoder stage's job
    yield strategy
    asyncio.run(strategy.engine.shutdown())


def _generate(strategy, request):
    """The encoder stage's conditions, then the strategy (as the graph chains them)."""
    family = strategy.family
    cond = family.conditioner.encode(strategy.encoders, [request.prompt])
    negative = None
    if doubles_rows(family.spec.guidance, request.sampling.guidance_scale):
        negative = family.conditioner.encode(strategy.encoders,
                                             [family.conditioner.unconditional(request.prompt)])
    return asyncio.run(strategy.generate(request, cond, negative))


def _request(strategy, **kw) -> RolloutRequest:
    prompt = strategy.family.conditioner.tokenize(["a green triangle"])[0]
    sampling = kw.pop("sampling", SamplingSpec(num_steps=4, seeds=(1, 2)))
    return RolloutRequest(prompt=prompt, sampling=sampling, task=kw.pop("task", Task.T2I), **kw)


def test_diffusion_strategy_returns_latents_and_decode_plan(diffusion):
    assert isinstance(diffusion, DiffusionStrategy)
    out = _generate(diffusion, _request(diffusion, requested_artifacts=("image",)))
    # only latents come back; the decoded name is recorded with its source for the decoder stage
    assert set(out.artifacts) == {"image_latent"}
    assert out.metadata["decode"] == {"image": "image_latent"}
    assert out.artifacts["image_latent"].data.shape == (2, 4, 8, 8)
    assert out.trajectory.log_probs.shape == (2, 3)
    assert out.policy_version == "base" and out.seeds == (1, 2)


def test_diffusion_strategy_cfg_uses_null_prompt(diffusion):
    sampling = SamplingSpec(num_steps=3, seeds=(4,), guidance_scale=3.0)
    out = _generate(diffusion, _request(diffusion, sampling=sampling))
    assert out.trajectory.guidance_scale == 3.0
    assert set(out.metadata["requested_artifacts"]) == {"image_latent", "image"}


@pytest.mark.parametrize("kw, error, field", [
    (dict(requested_artifacts=("audio",)), UndeclaredArtifactError, "requested_artifacts"),
    (dict(task=Task.T2VA), InvalidRequestError, "task"),
    (dict(media=(MediaInput(Modality.IMAGE, MediaRole.REFERENCE,
                            torch.zeros(3, 32, 32, dtype=torch.uint8)),)),
     InvalidRequestError, "media"),
    (dict(sampling=SamplingSpec(num_steps=4, seeds=(1,), height=64, width=64)),
     InvalidRequestError, "sampling.height"),
    (dict(sampling=SamplingSpec(num_steps=400, seeds=(1,))), LimitExceededError,
     "sampling.num_steps"),
    (dict(policy_version="v7"), PolicyVersionError, "policy_version"),
])
def test_diffusion_strategy_rejects_bad_requests(diffusion, kw, error, field):
    with pytest.raises(error) as err:
        _generate(diffusion, _request(diffusion, **kw))
    assert err.value.field == field


def test_packed_form_is_a_declared_option(tiny_checkpoint):
    from adapters.registry import get_family
    from rollout.strategy import _build_embedded
    engine = _build_embedded(RolloutConfig(packed_inference_form=True), get_family("tiny_t2i"))
    try:
        assert any(n.endswith("attn.to_qkv") for n, _ in
                   engine.models["transformer"].named_modules())
    finally:
        asyncio.run(engine.shutdown())
    from contract import ConfigError
    with pytest.raises(ConfigError) as err:       # a family without a packed form says so
        build_strategy(RolloutConfig(adapter="sd3", weights_path=str(tiny_checkpoint("sd3")),
                                     packed_inference_form=True), RequestLimits())
    assert err.value.field == "rollout.packed_inference_form"
