"""Hypothesis strategies for POST /rollout bodies: random JSON values and types, sizes, nesting,
unicode, numbers at int64 / float edges, NaN / Infinity, duplicated keys, bytes that are not
UTF-8, and one-field mutations of a valid body (so some cases run a real rollout)."""
from __future__ import annotations

import json

from hypothesis import strategies as st

from contract.http import HTTPRolloutRequest

CAPTION = "a red circle at the top left on a black background"
VALID_BODY = {"prompts": [CAPTION], "num_steps": 2, "samples_per_prompt": 1}
FIELDS = sorted(HTTPRolloutRequest.model_fields)

INT_EDGES = st.sampled_from([0, 1, -1, 2, 7, 8, 20, 21, 32, 2**31 - 1, 2**31, 2**53 + 1,
                             2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64, 10**9,
                             10**30, 10**400])
FLOAT_EDGES = st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, 100.0, 100.5, 5e-324,
                               2.2250738585072014e-308, 1.7976931348623157e308,
                               float("nan"), float("inf"), float("-inf")])
SCALARS = (st.none() | st.booleans() | INT_EDGES | st.integers() | FLOAT_EDGES
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
           | st.sampled_from(["t2i", "t2va", "sde", "ode", "cps", "image", "image_latent",
                              "base", "yes", "true", "1", "", " ", CAPTION]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()   # NaN / Infinity literals included


@st.composite
def _mutated(draw) -> bytes:
    """The valid body with one field replaced, added or removed."""
    body = dict(VALID_BODY)
    key = draw(st.sampled_from(FIELDS + ["bogus", "", "Prompts"]))
    if draw(st.integers(0, 9)) == 0:
        body.pop(key, None)
    else:
        body[key] = draw(JSON_VALUES)
    return _dumps(body)


@st.composite
def _duplicated_key(draw) -> bytes:
    key = draw(st.sampled_from(FIELDS))
    first, second = draw(JSON_VALUES), draw(JSON_VALUES)
    head = _dumps(VALID_BODY)[:-1].decode()
    return (f'{head}, "{key}": {json.dumps(first, allow_nan=True)}, '
            f'"{key}": {json.dumps(second, allow_nan=True)}}}').encode()


@st.composite
def _nested(draw) -> bytes:
    depth = draw(st.integers(1, 300_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    inner = opener * depth + "1" + closer * depth
    return (f'{{"prompts": {inner}}}' if draw(st.booleans()) else inner).encode()


@st.composite
def _sized(draw) -> bytes:
    """Big prompts / many prompts around the configured bounds and the body bound."""
    chars = draw(st.sampled_from([0, 1, 4095, 4096, 4097, 100_000, 800_000, 1_100_000]))
    count = draw(st.sampled_from([1, 4, 5, 1000, 100_000]))
    text = draw(st.sampled_from(["x", " ", "\u00e9", "\U0001f600", "\x00"]))
    prompts = [text * chars] if count == 1 else [text] * count
    return _dumps({"prompts": prompts, "num_steps": 2})


@st.composite
def _unicode_prompts(draw) -> bytes:
    prompts = draw(st.lists(st.text(min_size=0, max_size=60), min_size=1, max_size=5))
    return _dumps({"prompts": prompts, "num_steps": 2})


BODIES = st.one_of(
    _mutated(),
    JSON_VALUES.map(_dumps),                              # any JSON value as the whole body
    _duplicated_key(),
    _nested(),
    _sized(),
    _unicode_prompts(),
    st.binary(max_size=200),                              # not UTF-8 / not JSON at all
    st.binary(max_size=40).map(lambda b: _dumps(VALID_BODY)[:-1] + b),   # truncated / garbled
)
