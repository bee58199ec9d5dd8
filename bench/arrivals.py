"""Serving policies under staggered arrivals, for the rollout benchmark (bench/rollout_bench.py).

Requests arrive at Poisson times (seeded) and are served by one of:

  stepwise       the embedded engine: a request joins the running batch at the next denoising
                 step (continuous batching), finished rows leave at once
  static_batch   flow_grpo-style: when the executor is free it takes every request waiting (up to
                 `max_batch`) as one batch and denoises it to the end; arrivals wait for the next
  one_at_a_time  the same plain loop, one request per call, in arrival order

Each policy sees the same arrival times and requests; per request latency = finish - arrival;
each request's timeline splits it into the wait before its first step and the run after it.

The same policies are also simulated (`simulate_static`, `simulate_stepwise`) on a step time
fitted to the measured step-time-vs-rows curve (`robust_line`), with no scheduling overhead at all: what the best scheduler could reach
on that hardware, and which curve shape step-wise batching pays on.
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
    """Submit each request to the engine at its arrival; it batches per step. A request's wait
    is the engine's own queue_time_s (submit to its first step)."""
    arrived, finished = [0.0] * len(requests), [0.0] * len(requests)
    futures = []

    def enqueue(i: int, t: float) -> None:
        arrived[i] = t
        future = engine.submit(requests[i])
        future.add_done_callback(lambda f, i=i: finished.__setitem__(i, time.perf_counter()))
        futures.append(future)
    start = _replay(arrivals, enqueue)
    metrics = [f.result().metrics for f in futures]
    return _trace(start, arrived, finished, requests, [m["queue_time_s"] for m in metrics],
                  [m["batch_rows_mean"] for m in metrics])


def serve_batched(run_batch: Callable[[list], None], requests, arrivals: Sequence[float],
                  max_batch: int) -> dict:
    """A single executor: when idle, run every waiting request (<= max_batch) as one batch to
    completion. max_batch=1 is one request at a time."""
    arrived, finished = [0.0] * len(requests), [0.0] * len(requests)
    began = [0.0] * len(requests)
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
            now = time.perf_counter()
            for i in batch:
                began[i] = now
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
    sizes = {i: size for size, members in zip(batches, _members(batches)) for i in members}
    return _trace(start, arrived, finished, requests, [b - a for a, b in zip(arrived, began)],
                  [float(sizes[i]) for i in range(len(requests))])


def _members(batches: list[int]) -> list[range]:
    """The request indices of each batch (batches take the queue in arrival order)."""
    out, first = [], 0
    for size in batches:
        out.append(range(first, first + size))
        first += size
    return out


def _trace(start: float, arrived, finished, requests, waits, rows) -> dict:
    """One trace's per-request records: latency, wait before the first step, rows per forward."""
    return {"makespan_s": max(finished) - start,
            "samples": sum(r.request.sampling.samples_per_prompt for r in requests),
            "latency_s": [f - a for a, f in zip(arrived, finished)],
            "wait_s": list(waits), "rows": list(rows)}


def summarize(traces: Sequence[dict]) -> dict:
    """Throughput and latency percentiles over the requests of one or more traces (pooled);
    where the latency went: the wait before a request's first step and the run after it."""
    latency = [v for t in traces for v in t["latency_s"]]
    waits = [v for t in traces for v in t["wait_s"]]
    runs = [lat - w for t in traces for lat, w in zip(t["latency_s"], t["wait_s"])]
    return {"samples_per_s": sum(t["samples"] for t in traces) /
            sum(t["makespan_s"] for t in traces),
            "latency_p50_s": percentile(latency, 50), "latency_p95_s": percentile(latency, 95),
            "latency_mean_s": statistics.mean(latency),
            "makespan_s": statistics.mean(t["makespan_s"] for t in traces),
            "wait_p50_s": percentile(waits, 50), "wait_p95_s": percentile(waits, 95),
            "run_p50_s": percentile(runs, 50), "run_p95_s": percentile(runs, 95),
            "rows_per_forward_mean": statistics.mean(v for t in traces for v in t["rows"]),
            "requests": len(latency), "traces": len(traces)}


# ---- the same policies simulated on a measured step-time curve (no scheduling overhead) -------
def robust_line(rows: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed, per_row) of the line seconds = fixed + per_row x rows through the points, by
    Theil-Sen (the median of the pairwise slopes, then the median intercept): a point bent by
    a burst of load on a shared machine moves it far less than a least-squares fit."""
    pairs = [(seconds[j] - seconds[i]) / (rows[j] - rows[i])
             for i in range(len(rows)) for j in range(i + 1, len(rows)) if rows[j] != rows[i]]
    per_row = float(np.median(pairs))
    return float(np.median([t - per_row * r for r, t in zip(rows, seconds)])), per_row


def simulate_static(arrivals: Sequence[float], steps: int, step_s: Callable[[int], float],
                    max_batch: int, max_wait_s: float = 0.0) -> list[float]:
    """Latencies of a static batcher: when the executor is free it waits until `max_batch`
    requests are queued or the oldest has waited `max_wait_s` (0: starts at once, greedy), then
    runs the waiting requests (<= max_batch) to the end."""
    now, nxt, queue, latency = 0.0, 0, [], []
    while nxt < len(arrivals) or queue:
        if not queue:
            now = max(now, arrivals[nxt])
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            queue.append(arrivals[nxt])
            nxt += 1
        if len(queue) < max_batch and nxt < len(arrivals) and \
                arrivals[nxt] <= queue[0] + max_wait_s:
            now = max(now, arrivals[nxt])         # keep waiting for the next arrival
            continue
        if len(queue) < max_batch:                # it cannot know no one else comes
            now = max(now, queue[0] + max_wait_s)
        batch, queue = queue[:max_batch], queue[max_batch:]
        now += steps * step_s(len(batch))
        latency += [now - a for a in batch]
    return latency


def simulate_stepwise(arrivals: Sequence[float], steps: int, step_s: Callable[[int], float],
                      max_rows: int, order: str = "fair") -> list[float]:
    """Latencies of a step-wise engine: an arrival joins at the next step boundary; each step
    runs up to `max_rows` requests, picked `fair` (the engine's schedule: least recently
    stepped, then admission order) or `oldest` (admission order: running requests keep their
    rows, arrivals wait for free ones)."""
    now, nxt, tick, running, latency = 0.0, 0, 0, [], []
    while nxt < len(arrivals) or running:
        if not running:
            now = max(now, arrivals[nxt])
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            running.append({"arrived": arrivals[nxt], "left": steps, "tick": -1, "order": nxt})
            nxt += 1
        key = (lambda s: (s["tick"], s["order"])) if order == "fair" else \
            (lambda s: s["order"])
        picked = sorted(running, key=key)[:max_rows]
        tick += 1
        now += step_s(len(picked))
        for s in picked:
            s["left"] -= 1
            s["tick"] = tick
        latency += [now - s["arrived"] for s in running if not s["left"]]
        running = [s for s in running if s["left"]]
    return latency
