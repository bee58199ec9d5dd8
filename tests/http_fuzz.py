"""Hypothesis strategies for POST /rollout bodies: random JSON values and types, sizes, nesting,
unicode, numbers at int64 / float edges, NaN / Infinity, duplicated keys, bytes that are not
UTF-8, and one-field mutations of a valid body (so some cases run a real rollout); and whole
HTTP requests (`REQUESTS`): content types, Host headers, paths and methods a browser or a
rebound DNS name produces, number edges written as raw JSON text (1e400, 2**64, 1e-300) and
key floods, each labelled with whether its method, path, Host and content type are served."""
from __future__ import annotations

import json
from typing import NamedTuple

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


# --- whole HTTP requests --------------------------------------------------------------------
class HTTPCase(NamedTuple):
    method: str
    path: str                              # relative to the app's route prefix
    headers: tuple[tuple[str, str], ...]
    body: bytes
    served: bool                           # method, path, Host and content type all answered


GOOD_HOSTS = ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.1", "LocalHost"]
BAD_HOSTS = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
             "10.0.0.1:8000", "0.0.0.0:8000", "[::ffff:127.0.0.1]:8000", "", "127.0.0.1:8000, x"]
GOOD_TYPES = ["application/json", "application/json; charset=utf-8"]
BAD_TYPES = ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
             "multipart/form-data; boundary=----x", "application/xml", "application/json5",
             "application/json; charset=utf-16", "*/*", ""]
BAD_PATHS = ["/anything/rollout", "/rollout/", "/rollout/x", "/rollouts", "//rollout",
             "/api/v1/rollout", "/healthz/../rollout", "/%72ollout", "/", "/ROLLOUT"]

# numbers as a client can write them, not as Python would: overflow, underflow, past 64 bits
NUMBER_TEXTS = ["0", "-0", "0.0", "1", "1.0", "2", "1e2", "1E1", "0.7", "2.0000001", "-1",
                "1e-300", "1e-40", "5e-324", "1e-400", "1e400", "-1e400", "1e308", "NaN",
                "Infinity", "-Infinity", "9223372036854775807", "9223372036854775808",
                "18446744073709551615", "18446744073709551616", "-9223372036854775809",
                "1" + "0" * 400]
NUMBER_FIELDS = ["noise_level", "guidance_scale", "seed", "num_steps", "samples_per_prompt",
                 "height", "width", "num_frames", "metadata"]


def key_flood(where: str, keys: int) -> bytes:
    """A body of `keys` unknown keys: at the top, in one prompt's metadata, or in one field."""
    flood = {f"k{i}": 0 for i in range(keys)}
    body = {"top": VALID_BODY | flood, "metadata": VALID_BODY | {"metadata": [flood]},
            "nested": VALID_BODY | {"sde_window": flood}}[where]
    return json.dumps(body).encode()


@st.composite
def _number_edge(draw) -> bytes:
    field, text = draw(st.sampled_from(NUMBER_FIELDS)), draw(st.sampled_from(NUMBER_TEXTS))
    value = f'[{{"score_hint": {text}}}]' if field == "metadata" else text
    return _dumps(VALID_BODY)[:-1] + f', "{field}": {value}}}'.encode()


@st.composite
def _key_flood(draw) -> bytes:
    return key_flood(draw(st.sampled_from(["top", "metadata", "nested"])),
                     draw(st.sampled_from([20, 64, 1000, 50_000])))


@st.composite
def _http_request(draw) -> HTTPCase:
    """Mostly one thing wrong at a time, so each class is reached often."""
    wrong = draw(st.sampled_from(["none", "none", "host", "type", "path", "method"]))
    host = draw(st.sampled_from(BAD_HOSTS if wrong == "host" else GOOD_HOSTS))
    ctype = draw(st.sampled_from(BAD_TYPES if wrong == "type" else GOOD_TYPES))
    path = draw(st.sampled_from(BAD_PATHS)) if wrong == "path" else "/rollout"
    method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])) if wrong == "method" \
        else "POST"
    body = draw(st.one_of(st.just(_dumps(VALID_BODY)), _number_edge(), _key_flood(), _mutated()))
    headers = [("host", host)] if host else []
    headers += [("content-type", ctype)] if ctype else []
    headers.append(("content-length", str(len(body))))
    return HTTPCase(method, path, tuple(headers), body, wrong == "none")


REQUESTS = _http_request()
