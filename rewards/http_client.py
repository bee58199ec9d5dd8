"""JSON-over-HTTP calls for remote scorers: a total deadline, bounded reads, retries with backoff,
bounded concurrency.

`RetryPolicy` is the pydantic config part every remote scorer embeds. `JsonClient.post` sends one
JSON body and returns the decoded JSON answer, or raises RemoteScorerError after the policy:
    retried:     connection errors, timeouts, HTTP 429 and 5xx -- up to `retries` more attempts,
                 waiting backoff_s * 2**k (capped at max_backoff_s) before attempt k + 1;
    not retried: other 4xx (the request itself is wrong) and a 200 whose answer breaks the bounds
                 below or is not strict JSON.
At most `max_concurrency` calls of one client are in flight at once (a semaphore shared by every
thread that scores through it). Each attempt, connect to last byte, ends at `timeout_s` however
slowly the server trickles (the exchange runs on the client's own event loop and is cancelled
there). The answer is read as it streams in and refused once past `max_response_bytes`, counted
on the wire and again decompressed (gzip / deflate decoded here, with the output bounded: a
small bomb never inflates in memory). JSON is strict: no NaN / Infinity, no float that
overflows (1e400), integers within 64 bits, nesting <= MAX_JSON_DEPTH, no lone surrogate.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import zlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.errors import RemoteScorerError

MAX_JSON_DEPTH = 32          # nesting of an answer (a chat completion is ~6 deep)
_INT_RANGE = (-2**63, 2**64)


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(30.0, gt=0, description="per HTTP attempt, connect to last byte "
                             "(a total deadline, not per read)")
    retries: int = Field(2, ge=0, description="extra attempts after a retryable failure")
    backoff_s: float = Field(0.5, ge=0)
    max_backoff_s: float = Field(8.0, ge=0)
    max_concurrency: int = Field(4, ge=1, description="HTTP calls in flight per scorer")
    max_response_bytes: int = Field(8 << 20, ge=1024)


class JsonClient:
    def __init__(self, url: str, policy: RetryPolicy, scorer: str,
                 headers: dict[str, str] | None = None):
        import httpx

        self.url, self.policy, self.scorer = url, policy, scorer
        self._http = httpx.AsyncClient(timeout=policy.timeout_s, trust_env=False,
                                       headers={**(headers or {}),
                                                "accept-encoding": "gzip, deflate"})
        self._loop = asyncio.new_event_loop()          # where every exchange runs, and is cut
        threading.Thread(target=self._loop.run_forever, name=f"http-{scorer}",
                         daemon=True).start()
        self._slots = threading.BoundedSemaphore(policy.max_concurrency)
        self.attempts = 0            # HTTP attempts made (retries included), for tests / metrics

    def post(self, payload: dict[str, Any]) -> Any:
        import httpx

        p = self.policy
        body = json.dumps(payload, allow_nan=False).encode()
        last = "no attempt"
        for attempt in range(p.retries + 1):
            if attempt:
                time.sleep(min(p.max_backoff_s, p.backoff_s * 2 ** (attempt - 1)))
            with self._slots:
                self.attempts += 1
                exchange = asyncio.wait_for(self._exchange(body), p.timeout_s)
                try:
                    status, content = asyncio.run_coroutine_threadsafe(exchange,
                                                                       self._loop).result()
                except (TimeoutError, httpx.TimeoutException):
                    last = f"timed out after {p.timeout_s:g} s"
                    continue
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                    continue
            text = content[:300].decode("utf-8", "replace")
            if status == 429 or status >= 500:
                last = f"HTTP {status}: {text[:200]}"
                continue
            if status != 200:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} refused the request: "
                                        f"HTTP {status}: {text}",
                                        field=f"{self.scorer}.url", actual=status)
            try:
                return strict_json(content)
            except ValueError as e:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} answered malformed JSON: "
                                        f"{e}", field=f"{self.scorer}.response",
                                        actual=text[:200]) from None
        raise RemoteScorerError(f"remote scorer {self.scorer!r} failed after {p.retries + 1} "
                                f"attempts: {last}", field=f"{self.scorer}.url", actual=last)

    async def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """(status, decoded answer bytes) of one POST, read within max_response_bytes."""
        async with self._http.stream("POST", self.url, content=body,
                                     headers={"content-type": "application/json"}) as resp:
            return resp.status_code, await self._read_bounded(resp)

    async def _read_bounded(self, resp) -> bytes:
        bound, field = self.policy.max_response_bytes, f"{self.scorer}.response"

        def too_large(what: str, size: Any) -> RemoteScorerError:
            return RemoteScorerError(f"remote scorer {self.scorer!r} answered too much ({what})",
                                     field=field, expected=f"<= {bound} bytes", actual=size)
        declared = resp.headers.get("content-length", "")
        if declared.isdecimal() and int(declared) > bound:
            raise too_large("Content-Length", int(declared))
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip", "deflate"):
            raise RemoteScorerError(f"remote scorer {self.scorer!r} answered in an encoding this "
                                    "client does not decode", field=field,
                                    expected=["identity", "gzip", "deflate"], actual=encoding[:40])
        inflate = None if encoding == "identity" else \
            zlib.decompressobj(zlib.MAX_WBITS | (16 if "gzip" in encoding else 0))
        wire, out = 0, bytearray()
        async for chunk in resp.aiter_raw():
            wire += len(chunk)
            if wire > bound:
                raise too_large("on the wire", f"> {bound}")
            if inflate is None:
                out += chunk
                continue
            try:
                out += inflate.decompress(chunk, bound + 1 - len(out))   # output bounded
            except zlib.error as e:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} answered a broken "
                                        f"{encoding} stream: {e}", field=field) from None
            if len(out) > bound or inflate.unconsumed_tail:
                raise too_large("decompressed", f"> {bound}")
        if len(out) > bound:
            raise too_large("read", len(out))
        return bytes(out)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def strict_json(content: bytes | str) -> Any:
    """JSON as RFC 8259 has it: ValueError for bytes that are not UTF-8, NaN / Infinity, a float
    that overflows (1e400), an integer outside 64 bits, nesting deeper than MAX_JSON_DEPTH or a
    lone surrogate."""
    if isinstance(content, (bytes, bytearray)):
        content = content.decode("utf-8")       # never guessed as UTF-16 / 32 by json.loads
    try:
        value = json.loads(content, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_int64)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}") from None
    _check_tree(value)
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _int64(text: str) -> int:
    if len(text) > 21:                          # checked before converting a huge digit string
        raise ValueError(f"integer {text[:24]}... is outside 64 bits")
    value = int(text)
    if not _INT_RANGE[0] <= value < _INT_RANGE[1]:
        raise ValueError(f"integer {text} is outside 64 bits")
    return value


def _check_tree(value: Any) -> None:
    """Nesting and strings of a decoded JSON value, iteratively."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            for key, v in item.items():
                _check_text(key)
                stack.append((v, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"string holds a lone surrogate at {e.start}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")
