"""Serving policies under staggered arrivals, for the rollout benchmark (bench/rollout_bench.py).

Requests arrive at Poisson times (seeded) and are served by one of:

  stepwise       the embedded engine: a request joins the running batch at the next denoising
                 step (continuous batching), finished rows leave at once
  static_batch   flow_grpo-style: when the executor is free it takes every request waiting (up to
                 `max_batch`) as one batch and denoises it to the end; arrivals wait for the next
  one_at_a_time  the same plain loop, one request per call, in arrival order

Each policy sees the same arrival times and requests; per request latency = finish - arrival.
"""
from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Callable, Sequence

import numpy as np


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of `n` requests, exponential gaps of mean 1/rate, seeded."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n)
    return np.cumsum(gaps).tolist()


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _replay(arrivals: Sequence[float], enqueue: Callable[[int, float], None]) -> float:
    """Call enqueue(i, t_arrival) at each arrival time; returns the start time."""
    start = time.perf_counter()
    for i, offset in enumerate(arrivals):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        enqueue(i, time.perf_counter())
    return start


def serve_stepwise(engine, requests, arrivals: Sequence[float]) -> dict:
    """Submit each request to the engine at its arrival; it batches per step."""
    arrived, finished = [0.0] * len(requests), [0.0] * len(requests)
    futures = []

    def enqueue(i: int, t: float) -> None:
        arrived[i] = t
        future = engine.submit(requests[i])
        future.add_done_callback(lambda f, i=i: finished.__setitem__(i, time.perf_counter()))
        futures.append(future)
    start = _replay(arrivals, enqueue)
    for f in futures:
        f.result()
    return _summary(start, arrived, finished, requests)


def serve_batched(run_batch: Callable[[list], None], requests, arrivals: Sequence[float],
                  max_batch: int) -> dict:
    """A single executor: when idle, run every waiting request (<= max_batch) as one batch to
    completion. max_batch=1 is one request at a time."""
    arrived, finished = [0.0] * len(requests), [0.0] * len(requests)
    queue: collections.deque[int] = collections.deque()
    cv = threading.Condition()
    remaining = [len(requests)]
    batches: list[int] = []

    def executor() -> None:
        while True:
            with cv:
                while not queue and remaining[0]:
                    cv.wait()
                if not remaining[0]:
                    return
                batch = [queue.popleft() for _ in range(min(max_batch, len(queue)))]
            run_batch([requests[i] for i in batch])
            now = time.perf_counter()
            with cv:
                for i in batch:
                    finished[i] = now
                remaining[0] -= len(batch)
                batches.append(len(batch))
                cv.notify_all()

    thread = threading.Thread(target=executor, daemon=True)
    thread.start()

    def enqueue(i: int, t: float) -> None:
        with cv:
            arrived[i] = t
            queue.append(i)
            cv.notify_all()
    start = _replay(arrivals, enqueue)
    thread.join()
    return _summary(start, arrived, finished, requests) | {
        "mean_batch": statistics.mean(batches)}


def _summary(start: float, arrived, finished, requests) -> dict:
    latency = [f - a for a, f in zip(arrived, finished)]
    rows = sum(r.request.sampling.samples_per_prompt for r in requests)
    span = max(finished) - start
    return {"samples_per_s": rows / span, "latency_p50_s": percentile(latency, 50),
            "latency_p95_s": percentile(latency, 95), "latency_mean_s": statistics.mean(latency),
            "makespan_s": span}
