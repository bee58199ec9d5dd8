"""The traffic of a chaos run (testing/chaos.py) and its ledger: closed-loop clients through the
ingress handle and over HTTP, one request in flight each, a retryable failure retried with the
same id; the ledger records every id sent and what came back (answered once, failed retryable,
or a defect: untyped, lost, answered twice or as another id).
"""
from __future__ import annotations

import collections
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

RETRYABLE = {"ReplicaFailedError", "StageUnavailableError", "QueueFullError"}
PROMPTS = ("a red circle at the top left on a black background",
           "a blue square in the center on a white background",
           "a green triangle at the bottom right on a black background")


# ---- the ledger ------------------------------------------------------------------------------
@dataclass
class Ledger:
    answers: collections.Counter = field(default_factory=collections.Counter)
    retryable: collections.Counter = field(default_factory=collections.Counter)  # by kind
    failed_ids: set = field(default_factory=set)       # ids that failed at least once
    defects: list = field(default_factory=list)         # untyped, lost, mismatched ids
    sent: set = field(default_factory=set)
    server_ids: collections.Counter = field(default_factory=collections.Counter)   # HTTP
    examples: dict = field(default_factory=dict)       # kind -> first message
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, rid: str, server_id: str | None = None) -> None:
        with self.lock:
            self.answers[rid] += 1
            if server_id is not None:
                self.server_ids[server_id] += 1

    def failure(self, rid: str, kind: str, message: str = "") -> None:
        with self.lock:
            self.retryable[kind] += 1
            self.failed_ids.add(rid)
            self.examples.setdefault(kind, message[:300])

    def defect(self, rid: str, what: str) -> None:
        with self.lock:
            self.defects.append(f"{rid}: {what}"[:400])

    def summary(self) -> dict[str, Any]:
        with self.lock:
            never = sorted(r for r in self.sent if self.answers[r] == 0)
            return {
                "requests": len(self.sent),
                "answered": sum(1 for r in self.sent if self.answers[r] >= 1),
                "answered_twice": sum(1 for c in self.answers.values() if c > 1)
                + sum(1 for c in self.server_ids.values() if c > 1),
                "failed_retryable": dict(self.retryable),
                "failed_then_answered": sum(1 for r in self.failed_ids if self.answers[r] == 1),
                "never_answered": len(never),
                "untyped_or_lost": len(self.defects),
                "defects": list(self.defects[:10]),
                "failure_examples": dict(self.examples),
            }


# ---- traffic ---------------------------------------------------------------------------------
class Traffic:
    """Closed-loop clients, one request in flight each: `handle_workers` through the ingress
    handle (RolloutClient: the caller's whole path, outputs fetched), `http_workers` over HTTP.
    A retryable failure is retried with the same id after `backoff_s` (at most `attempts`
    times); after `stop()` each worker finishes the id it holds, so no id is left unresolved."""

    def __init__(self, ledger: Ledger, handle, family, http_url: str | None, tag: str,
                 handle_workers: int = 1, http_workers: int = 1, steps: int = 4,
                 samples: int = 2, backoff_s: float = 2.0, attempts: int = 30,
                 timeout_s: float = 240.0):
        self.ledger, self.handle, self.family, self.url = ledger, handle, family, http_url
        self.tag, self.steps, self.samples = tag, steps, samples
        self.backoff_s, self.attempts, self.timeout_s = backoff_s, attempts, timeout_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(self._handle_call, f"h{i}"),
                                          daemon=True) for i in range(handle_workers)]
        if http_url:
            self._threads += [threading.Thread(target=self._loop, args=(self._http_call,
                                                                        f"x{i}"), daemon=True)
                              for i in range(http_workers)]
        self._bundles = family.conditioner.tokenize(list(PROMPTS))

    def start(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self, join_s: float = 600.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 1.0))

    def _loop(self, call: Callable[[str, int], str | None], worker: str) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            rid = f"{self.tag}-{worker}-{n}"
            with self.ledger.lock:
                self.ledger.sent.add(rid)
            for attempt in range(self.attempts):
                kind = call(rid, n)
                if kind is None:
                    break
                time.sleep(self.backoff_s)
            else:
                self.ledger.defect(rid, f"still failing after {self.attempts} attempts")

    def _handle_call(self, rid: str, n: int) -> str | None:
        """One attempt; None when answered (or a defect recorded), else the retryable kind."""
        from contract import RolloutError, RolloutRequest, SamplingSpec, Task
        from deployments.client import RolloutClient
        request = RolloutRequest(
            prompt=self._bundles[n % len(self._bundles)], task=Task.T2I, request_id=rid,
            sampling=SamplingSpec(num_steps=self.steps,
                                  seeds=tuple(range(n * 10, n * 10 + self.samples))))
        try:
            [out] = RolloutClient(self.handle).collect(
                self.handle.rollout.remote([request]))
        except RolloutError as exc:
            if exc.retryable:
                kind = f"{error_name(exc)}[{exc.field}]"
                self.ledger.failure(rid, kind, f"{exc.message} (actual={exc.actual})")
                return kind
            self.ledger.defect(rid, f"non-retryable {error_name(exc)}: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 -- untyped: a defect
            self.ledger.defect(rid, f"untyped {type(exc).__name__}: {exc}")
            return None
        if out.request_id != rid or len(out.rewards.total) != self.samples:
            self.ledger.defect(rid, f"answered as {out.request_id!r}")
            return None
        self.ledger.answer(rid)
        return None

    def _http_call(self, rid: str, n: int) -> str | None:
        body = json.dumps({"prompts": [PROMPTS[n % len(PROMPTS)]], "num_steps": self.steps,
                           "samples_per_prompt": self.samples, "seed": n}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = exc.read()
            kind = classify_http_error(exc.code, body)
            if kind is None:
                self.ledger.defect(rid, f"HTTP {exc.code} untyped: {body[:300]!r}")
                return None
            if kind.split("[")[0] in RETRYABLE or kind.startswith("proxy"):
                self.ledger.failure(rid, kind)
                return kind
            self.ledger.defect(rid, f"HTTP {exc.code} non-retryable {kind}")
            return None
        except Exception as exc:  # noqa: BLE001 -- no answer: lost
            self.ledger.defect(rid, f"no HTTP answer: {type(exc).__name__}: {exc}")
            return None
        results = payload.get("results", [])
        if len(results) != 1 or len(results[0].get("samples", [])) != self.samples:
            self.ledger.defect(rid, f"malformed answer {str(payload)[:200]}")
            return None
        self.ledger.answer(rid, results[0]["request_id"])
        return None


def error_name(exc: BaseException) -> str:
    """The contract error class of `exc` (Ray wraps a stage's error in RayTaskError(<it>))."""
    from contract import RolloutError
    for cls in type(exc).__mro__:
        if issubclass(cls, RolloutError) and cls.__module__.startswith("contract"):
            return cls.__name__
    return type(exc).__name__


def classify_http_error(status: int, body: bytes) -> str | None:
    """A typed JSON error -> "<Type>[<field>]". The ingress answers every request with JSON,
    a failure included; a 500 that is not JSON ("Internal Server Error") is Serve's proxy
    answering for an ingress replica that died under the request -> "proxy500[ingress died]",
    retryable (the one answer the graph cannot type); a bare 503 is the proxy's "no replica".
    Anything else -> None (untyped)."""
    try:
        error = json.loads(body)["error"]
        return f"{error['type']}[{error.get('field')}]"
    except (ValueError, KeyError, TypeError):
        if status == 500:
            return "proxy500[ingress died]"
        if status == 503:
            return "proxy503[unavailable]"
        return None
