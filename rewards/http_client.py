"""JSON-over-HTTP calls for remote scorers: timeouts, retries with backoff, bounded concurrency.

`RetryPolicy` is the pydantic config part every remote scorer embeds. `JsonClient.post` sends one
JSON body and returns the decoded JSON answer, or raises RemoteScorerError after the policy:
    retried:     connection errors, timeouts, HTTP 429 and 5xx -- up to `retries` more attempts,
                 waiting backoff_s * 2**k (capped at max_backoff_s) before attempt k + 1;
    not retried: other 4xx (the request itself is wrong) and a 200 whose body is not JSON.
At most `max_concurrency` calls of one client are in flight at once (a semaphore shared by every
thread that scores through it); answers larger than `max_response_bytes` are refused.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.errors import RemoteScorerError


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(30.0, gt=0, description="per HTTP call (connect + read)")
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
        self._http = httpx.Client(timeout=policy.timeout_s, headers=headers or {},
                                  trust_env=False)
        self._slots = threading.BoundedSemaphore(policy.max_concurrency)
        self.attempts = 0            # HTTP attempts made (retries included), for tests / metrics

    def post(self, payload: dict[str, Any]) -> Any:
        import httpx

        p = self.policy
        last = "no attempt"
        for attempt in range(p.retries + 1):
            if attempt:
                time.sleep(min(p.max_backoff_s, p.backoff_s * 2 ** (attempt - 1)))
            with self._slots:
                self.attempts += 1
                try:
                    resp = self._http.post(self.url, json=payload)
                except httpx.TimeoutException:
                    last = f"timed out after {p.timeout_s:g} s"
                    continue
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                    continue
            if resp.status_code == 429 or resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code != 200:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} refused the request: "
                                        f"HTTP {resp.status_code}: {resp.text[:300]}",
                                        field=f"{self.scorer}.url", actual=resp.status_code)
            if len(resp.content) > p.max_response_bytes:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} answered too much",
                                        field=f"{self.scorer}.response",
                                        expected=f"<= {p.max_response_bytes} bytes",
                                        actual=len(resp.content))
            try:
                return json.loads(resp.content, parse_constant=_refuse_constant)
            except ValueError as e:
                raise RemoteScorerError(f"remote scorer {self.scorer!r} answered malformed JSON: "
                                        f"{e}", field=f"{self.scorer}.response",
                                        actual=resp.text[:200]) from None
        raise RemoteScorerError(f"remote scorer {self.scorer!r} failed after {p.retries + 1} "
                                f"attempts: {last}", field=f"{self.scorer}.url", actual=last)

    def close(self) -> None:
        self._http.close()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")
