"""One request never fails the requests batched with it, and nothing non-finite leaves the engine.

In process, on the real tiny_t2i architecture (seeded random DiT): a poisoned request packed into
one forward with three valid ones fails alone, typed, with its request id, and the three valid
requests' outputs are bitwise those of a run without it; a noise level float32 cannot carry is
refused at admission, naming the field and the value.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from pydantic import ValidationError

from adapters.tiny_t2i import TinyT2IFamily
from contract import (Condition, InvalidRequestError, NonFiniteOutputError, OutputContractError,
                      RolloutRequest, SamplerKind, SamplingSpec, Task)
from contract.request import MIN_NOISE_LEVEL
from diffusion.samplers import check_noise_representable
from rollout.config import EngineLimits
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from rollout.recorder import SampleRecorder

torch.set_num_threads(1)
STEPS = 4


@pytest.fixture(scope="module")
def t2i():
    family = TinyT2IFamily()
    encoders = family.load_encoders()
    prompts = family.conditioner.tokenize(["a red circle at the top", "a blue square",
                                           "a green triangle"])
    conds = [family.conditioner.encode(encoders, [p]) for p in prompts]
    return family, prompts, conds


def _engine(family, model=None) -> EmbeddedEngine:
    model = model if model is not None else family.build(seed=0)["transformer"]
    return EmbeddedEngine(family, {"transformer": model}, {}, EngineLimits(max_batch_rows=16))


def _request(t2i, i: int, seeds, sampling: SamplingSpec | None = None,
             cond: Condition | None = None) -> EngineRequest:
    _, prompts, conds = t2i
    sampling = sampling or SamplingSpec(sampler=SamplerKind.SDE, num_steps=STEPS,
                                        seeds=tuple(seeds))
    rr = RolloutRequest(prompt=prompts[i % 3], sampling=sampling, task=Task.T2I,
                        policy_version="base", request_id=f"req-{i}-{seeds[0]}")
    return EngineRequest(rr, cond if cond is not None else conds[i % 3], None,
                         ("image_latent",), {}, "base")


VALID = [(0, (11, 12)), (1, (21,)), (2, (31, 32, 33))]


def _valid(t2i) -> list[EngineRequest]:
    return [_request(t2i, i, seeds) for i, seeds in VALID]


def _run_together(engine: EmbeddedEngine, requests: list[EngineRequest]):
    """Submit while the engine is paused, so all are admitted at once and share every forward
    they can; returns (result or exception) per request."""
    asyncio.run(engine.sleep())
    futures = [engine.submit(r) for r in requests]
    asyncio.run(engine.wake_up())
    out = []
    for future in futures:
        try:
            out.append(future.result(timeout=300))
        except Exception as exc:  # noqa: BLE001 - the caller compares types
            out.append(exc)
    return out


def _assert_bitwise(alone, packed) -> None:
    for a, p in zip(alone, packed):
        assert not isinstance(p, BaseException), p
        assert torch.equal(a.trajectory.latents, p.trajectory.latents)
        assert torch.equal(a.trajectory.log_probs, p.trajectory.log_probs)
        assert torch.equal(a.latents["image_latent"].data, p.latents["image_latent"].data)
        assert a.metrics["forwards"] == p.metrics["forwards"] == STEPS
        # the three shared every forward, as they did without the poisoned request
        assert p.metrics["batch_rows_min"] == p.metrics["batch_rows_max"] == 6


def _shutdown(engine):
    asyncio.run(engine.shutdown())


def _poisoned_cond(t2i) -> Condition:
    """The first prompt's condition with an Inf in its hidden states (one bad encoder output)."""
    cond = t2i[2][0]
    hidden = cond["hidden"].clone()
    hidden.view(-1)[5] = float("inf")
    return Condition({**cond.tensors, "hidden": hidden}, cond.token_ids)


def test_non_finite_row_fails_alone_and_the_others_are_bitwise_a_run_without_it(t2i):
    family = t2i[0]
    engine = _engine(family)
    try:
        alone = _run_together(engine, _valid(t2i))
        poisoned = _request(t2i, 0, (41, 42), cond=_poisoned_cond(t2i))
        packed = _run_together(engine, [poisoned, *_valid(t2i)])
    finally:
        _shutdown(engine)
    error = packed[0]
    assert isinstance(error, NonFiniteOutputError), error      # the server's fault, not a 400
    assert error.request_id == poisoned.request.request_id
    assert error.http_status == 500 and error.field.startswith("velocity")
    _assert_bitwise(alone, packed[1:])


def test_forward_that_raises_on_one_request_fails_that_request_only(t2i):
    """A model that refuses a non-finite input raises for the whole batched forward: each
    request runs alone to find the one it came from, the rest run together again."""
    family = t2i[0]
    model = family.build(seed=0)["transformer"]

    def refuse_non_finite(module, args, kwargs):
        if not bool(torch.isfinite(kwargs["encoder_hidden_states"]).all()):
            raise ValueError("non-finite encoder_hidden_states")
    model.register_forward_pre_hook(refuse_non_finite, with_kwargs=True)
    engine = _engine(family, model)
    try:
        alone = _run_together(engine, _valid(t2i))
        poisoned = _request(t2i, 0, (41, 42), cond=_poisoned_cond(t2i))
        packed = _run_together(engine, [*_valid(t2i)[:2], poisoned, _valid(t2i)[2]])
    finally:
        _shutdown(engine)
    error = packed[2]
    assert type(error) is OutputContractError and error.http_status == 500, error
    assert error.request_id == poisoned.request.request_id
    _assert_bitwise(alone, packed[:2] + packed[3:])


@pytest.mark.parametrize("noise_level", [1e-300, 1e-40, 1e-20])
def test_unrepresentable_noise_level_is_refused_at_admission_not_in_the_batch(t2i, noise_level):
    """The spec's validator refuses it (the common case); a spec built around the validator
    (model_construct) is refused by the engine's check on the request's own schedule, and the
    requests it was submitted with run exactly as without it."""
    with pytest.raises(ValidationError) as err:
        SamplingSpec(sampler=SamplerKind.SDE, num_steps=STEPS, noise_level=noise_level,
                     seeds=(1,))
    assert err.value.errors()[0]["loc"] == ("noise_level",)
    family = t2i[0]
    spec = SamplingSpec.model_construct(**{**SamplingSpec(num_steps=STEPS, seeds=(41,))
                                           .model_dump(), "noise_level": noise_level})
    engine = _engine(family)
    try:
        alone = _run_together(engine, _valid(t2i))
        tiny = _request(t2i, 0, (41,), sampling=spec)
        packed = _run_together(engine, [tiny, *_valid(t2i)])
    finally:
        _shutdown(engine)
    error = packed[0]
    assert type(error) is InvalidRequestError, error
    assert (error.field, error.actual) == ("sampling.noise_level", noise_level)
    assert error.request_id == tiny.request.request_id and error.http_status == 400
    _assert_bitwise(alone, packed[1:])


@pytest.mark.parametrize("kind", sorted(MIN_NOISE_LEVEL, key=lambda k: k.value))
def test_declared_minimum_noise_level_is_representable_on_long_schedules(t2i, kind):
    """At each kind's declared minimum every window step of a 100-step schedule has a usable
    std (the engine's check passes), and a level far below it is refused by both checks."""
    family = t2i[0]
    least = MIN_NOISE_LEVEL[kind]
    for noise_level in (least, 1.0):
        sampling = SamplingSpec(sampler=kind, num_steps=100, noise_level=noise_level,
                                seeds=(0,))
        check_noise_representable(kind, family.sigmas(sampling), sampling.window, noise_level)
    with pytest.raises(ValidationError):
        SamplingSpec(sampler=kind, num_steps=100, noise_level=least / 2, seeds=(0,))
    sampling = SamplingSpec(sampler=kind, num_steps=100, seeds=(0,))
    with pytest.raises(InvalidRequestError) as err:
        check_noise_representable(kind, family.sigmas(sampling), sampling.window, 1e-300)
    assert err.value.field == "sampling.noise_level"


def test_recorder_refuses_a_non_finite_log_prob_without_recording_the_step():
    """A sample whose log-density is not finite (std squaring to 0 in float32) is a typed
    server-side error naming the step, and the recorder's state is left as it was."""
    spec = SamplingSpec.model_construct(**{**SamplingSpec(num_steps=3, seeds=(0, 1))
                                           .model_dump(), "noise_level": 1e-40})
    sigmas = torch.tensor([1.0, 0.6, 0.3, 0.0])
    recorder = SampleRecorder(spec, sigmas, request_id="r1")
    x = torch.randn(2, 4, 2, 2)
    with pytest.raises(NonFiniteOutputError) as err:
        recorder.propose(x, torch.randn_like(x))
    assert err.value.request_id == "r1" and err.value.field == "log_probs[step 0]"
    assert isinstance(err.value, OutputContractError) and err.value.http_status == 500
    assert recorder.step == 0 and recorder.latents == [] and recorder.log_probs == []
    nan_v = torch.randn_like(x)
    nan_v[1, 0, 0, 0] = float("nan")
    ok = SampleRecorder(SamplingSpec(num_steps=3, seeds=(0, 1)), sigmas, request_id="r2")
    with pytest.raises(NonFiniteOutputError) as err:
        ok.propose(x, nan_v)
    assert err.value.actual == "rows [1]" and err.value.field == "velocity[step 0]"
    step = ok.propose(x, torch.randn_like(x))
    assert dataclasses.is_dataclass(step) and ok.step == 0
    ok.commit(step)
    assert ok.step == 1 and len(ok.log_probs) == 1
