"""The handle API's side of the request boundary, in process: RolloutRequest construction and the
shared request checks fuzzed (only typed errors, and what passes is within every bound), and how
the ingress classifies a required scorer's failure (client's input 4xx, server's fault 5xx)."""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from contract import (MediaFormatError, MediaInput, MediaRole, Modality, PromptBundle,
                      ReplicaFailedError, RequestLimits, RolloutError, RolloutRequest,
                      SamplingSpec, ScorerFailedError, Task, UnscorableInputError,
                      check_requested_artifacts)

LIMITS = RequestLimits(max_prompts=4, max_samples_per_prompt=8, max_steps=20, max_height=32,
                       max_width=32, max_frames=1, max_tokens=32, max_artifacts=4)
INTS = st.sampled_from([0, 1, -1, 7, 8, 9, 20, 21, 32, 33, 2**31, 2**63 - 1, 2**63, 2**64 - 1,
                        2**64, -2**63]) | st.integers(-10, 40)
FLOATS = st.sampled_from([0.0, -0.0, 0.7, 1.0, 2.0, 100.0, 1e300, float("nan"), float("inf"),
                          -1.0]) | st.floats(-5, 200)
JUNK = st.none() | st.booleans() | st.text(max_size=8) | st.binary(max_size=4) | st.just([1, 2])
IDS = st.lists(INTS, max_size=40).map(tuple) | JUNK
MAYBE = lambda s: st.none() | s                                               # noqa: E731


def _tensor(draw) -> torch.Tensor | np.ndarray:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=5)))
    dtype = draw(st.sampled_from([torch.uint8, torch.float32, torch.int64, torch.float16]))
    data = torch.zeros(shape, dtype=dtype)
    if dtype.is_floating_point and data.numel() and draw(st.booleans()):
        data.view(-1)[0] = float("nan")
    return data.numpy() if draw(st.booleans()) and dtype != torch.float16 else data


@st.composite
def _media(draw):
    if draw(st.integers(0, 3)) == 0:
        return draw(JUNK)
    items = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 5)) == 0:
            items.append(draw(JUNK))
        else:
            items.append(MediaInput(draw(st.sampled_from(list(Modality))),
                                    draw(st.sampled_from(list(MediaRole))), _tensor(draw)))
    return tuple(items)


# per field: random values around its bounds and of wrong types
PROMPT_FIELDS = {"token_ids": IDS, "attention_mask": MAYBE(IDS),
                 "text": MAYBE(st.text(max_size=60)),
                 "encoder_token_ids": st.dictionaries(st.text(max_size=6), IDS, max_size=2) | JUNK}
SAMPLING_FIELDS = {"sampler": st.sampled_from(["sde", "ode", "cps", "dpm2", "bogus", 3]),
                   "num_steps": INTS, "noise_level": FLOATS, "guidance_scale": FLOATS,
                   "sde_window": MAYBE(st.tuples(INTS, INTS)),
                   "seeds": st.lists(INTS, max_size=12).map(tuple) | JUNK,
                   "height": INTS, "width": INTS, "num_frames": INTS}
REQUEST_FIELDS = {"task": st.sampled_from(list(Task)) | JUNK, "media": _media(),
                  "requested_artifacts": MAYBE(st.lists(
                      st.sampled_from(["image", "image_latent", "audio", ""]) | JUNK,
                      max_size=6).map(tuple)),
                  "policy_version": MAYBE(st.text(max_size=10)) | JUNK,
                  "request_id": st.text(max_size=140) | JUNK,
                  "metadata": st.dictionaries(st.text(max_size=4), JUNK, max_size=2) | JUNK}


@st.composite
def _request_parts(draw, valid_ids: tuple[int, ...]) -> dict:
    """A valid request with 1-4 of its fields replaced by random values."""
    parts = {"prompt": dict(token_ids=valid_ids, text="a red circle at the top left on a "
                                                      "black background"),
             "sampling": dict(num_steps=4, seeds=(0, 1), height=32, width=32, num_frames=1),
             "request": dict(task=Task.T2I)}
    fields = {"prompt": PROMPT_FIELDS, "sampling": SAMPLING_FIELDS, "request": REQUEST_FIELDS}
    for _ in range(draw(st.integers(1, 4))):
        part = draw(st.sampled_from(sorted(fields)))
        key = draw(st.sampled_from(sorted(fields[part])))
        parts[part][key] = draw(fields[part][key])
    return parts


@pytest.fixture(scope="module")
def family():
    from adapters.registry import get_family
    return get_family("tiny_t2i")


def test_rollout_request_construction_and_checks_raise_only_typed_errors(family):
    """Random field values and types: building the request and running the checks the ingress
    and the rollout stage share raise a typed error or nothing; what passes is in bounds."""
    valid_ids = family.conditioner.tokenize(["a red circle"])[0].token_ids

    @settings(max_examples=400, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_request_parts(valid_ids))
    def case(parts):
        try:
            prompt = PromptBundle(**parts["prompt"])
            sampling = SamplingSpec(**parts["sampling"])
            request = RolloutRequest(prompt=prompt, sampling=sampling, **parts["request"])
            family.validate_request(request, LIMITS)
            check_requested_artifacts(request, family.io_spec.names)
        except (ValidationError, RolloutError):
            return
        s = request.sampling
        assert 1 <= len(s.seeds) <= LIMITS.max_samples_per_prompt
        assert all(0 <= seed < 2**64 for seed in s.seeds)
        assert s.num_steps <= LIMITS.max_steps and s.guidance_scale <= LIMITS.max_guidance_scale
        assert (s.height, s.width, s.num_frames) == (32, 32, 1)
        assert 1 <= len(request.prompt.token_ids) <= LIMITS.max_tokens
        assert min(request.prompt.token_ids) >= 0
        assert len(request.requested_artifacts or ()) <= LIMITS.max_artifacts

    case()


def _ingress_with_required_scorer():
    """The ingress's failure classification needs only its scorer specs."""
    from deployments.config import ScorerStage
    spec = ScorerStage(name="verifier", scorer={"kind": "image_attributes"}, inputs=("image",),
                       reward={"policy": "required"})
    return types.SimpleNamespace(scorer_specs={"verifier": spec})


def test_oversized_http_bodies_are_refused_before_allocating_what_they_ask_for():
    """parse_rollout_body refuses each oversized body with a 413 naming the field while the
    Python memory it traced peaks below twice the body's own bytes plus 64 KiB: proportional at
    most to the body (itself bounded by max_body_bytes), never to the 10^9 samples, 10^7 steps or
    10^6 px asked for. tracemalloc counts allocations, so this holds on a loaded machine too."""
    import json
    import tracemalloc

    from testing.oversized import LIMITS as BENCH_LIMITS
    from testing.oversized import OVERSIZED
    from contract import LimitExceededError
    from contract.http import parse_rollout_body
    limits, peaks = RequestLimits(**BENCH_LIMITS), {}
    for body, field in OVERSIZED:
        data = json.dumps(body).encode()
        tracemalloc.start()
        try:
            with pytest.raises(LimitExceededError) as refused:
                parse_rollout_body(data, limits)
            peaks[field] = (tracemalloc.get_traced_memory()[1], len(data))
        finally:
            tracemalloc.stop()
        assert refused.value.field == field and refused.value.http_status == 413, refused.value
    print(f"traced peak vs body bytes: {peaks}")
    assert all(peak < 2 * size + 64 * 1024 for peak, size in peaks.values()), peaks


@pytest.mark.parametrize("exc, checked, error, status", [
    # the scorer's prompt check: the client's prompt, already naming scorer and request
    (UnscorableInputError("cannot read this prompt", field="prompts[0]"), True,
     UnscorableInputError, 422),
    # found while scoring: still the client's input (a caption, its condition media)
    (UnscorableInputError("caption part 'shape'", field="verifier.prompts[0]"), False,
     UnscorableInputError, 422),
    # generated media the scorer cannot read, a timeout, a bug: the server's fault
    (MediaFormatError("needs decoded media", field="verifier.artifacts.image"), False,
     ScorerFailedError, 502),
    (asyncio.TimeoutError(), False, ScorerFailedError, 502),
    (ValueError("scorer bug"), False, ScorerFailedError, 502),
])
def test_required_scorer_failure_is_4xx_only_for_the_clients_input(exc, checked, error, status):
    from deployments.ingress import RolloutGraph
    with pytest.raises(error) as raised:
        RolloutGraph._raise_required_failure(_ingress_with_required_scorer(), "verifier", exc,
                                             2, "req-1", checked=checked)
    assert raised.value.http_status == status
    assert raised.value.request_id == "req-1" or checked


def test_a_dead_scorer_replica_is_a_retryable_503():
    from ray.exceptions import ActorDiedError

    from deployments.ingress import RolloutGraph
    with pytest.raises(ReplicaFailedError) as raised:
        RolloutGraph._raise_required_failure(_ingress_with_required_scorer(), "verifier",
                                             ActorDiedError(), 2, "req-2")
    assert raised.value.http_status == 503 and raised.value.retryable
    assert raised.value.field == "scorer.verifier"
