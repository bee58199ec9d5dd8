"""Rollout throughput: the step-wise batching engine against the baselines a user would pick.

`python -m bench.rollout_bench` measures, side by side in one run on tiny_t2i (shipped weights):

All requests arrive together (N requests, one row each, same steps and sampler):
  engine_concurrent   the embedded engine with all N in flight (rows packed per step)
  engine_sequential   the same engine, one request at a time
  static_batch        flow_grpo-style: all N rows stacked into one call of a plain denoising loop
  one_at_a_time_loop  the same plain loop, one request per call
Staggered arrivals (Poisson, fixed seed, the same offered load for every policy; bench/arrivals.py):
  stepwise / static_batch / one_at_a_time: samples/s and latency p50 / p95 -- the case continuous
  batching exists for (a request joins at the next step instead of waiting for a batch to end).

Ratios: batching_speedup = engine_concurrent / engine_sequential; vs_static_batch =
engine_concurrent / static_batch (the honest peer: ~1x when all arrive together);
vs_one_at_a_time_loop = engine_concurrent / one_at_a_time_loop (the figure once called
vs_diffusers_loop: a peer that batches nothing). Writes bench/results/rollout.json + .png.
Peak memory per mode: peak RSS above the post-load RSS (sampled every 2 ms) during one run of
the mode, each mode in its own fresh process.
Each mode is run `repeats` times after a warm-up, the modes taking turns; the median is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from adapters.registry import get_family
from bench.arrivals import poisson_arrivals, serve_batched, serve_stepwise
from contract import Condition, RolloutRequest, SamplerKind, SamplingSpec, Task
from diffusion.noise import initial_noise, row_noise
from diffusion.step import Guidance, denoise_step
from diffusion.windows import uses_sde
from rollout.config import EngineLimits
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["a red circle", "a blue square at the top", "a green triangle", "a yellow star",
           "a small red square", "a big blue circle", "a green circle on the left",
           "a yellow triangle at the bottom"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS above the starting RSS while the block runs (sampled in a thread)."""

    def __enter__(self):
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        self.mib = (self.peak - self.start) / 2**20


def _requests(adapter, encoders, n: int, steps: int) -> list[EngineRequest]:
    prompts = adapter.conditioner.tokenize([PROMPTS[i % len(PROMPTS)] for i in range(n)])
    out = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingSpec(sampler=SamplerKind.SDE, num_steps=steps, seeds=(1000 + i,))
        rr = RolloutRequest(prompt=prompt, sampling=sampling, task=Task.T2I)
        cond = adapter.conditioner.encode(encoders, [prompt])
        out.append(EngineRequest(rr, cond, None, ("image_latent",), {}, "base"))
    return out


def run_concurrent(engine: EmbeddedEngine, requests: list[EngineRequest]) -> None:
    futures = [engine.submit(r) for r in requests]
    for f in futures:
        f.result()


def run_sequential(engine: EmbeddedEngine, requests: list[EngineRequest]) -> None:
    for r in requests:
        engine.submit(r).result()


@torch.no_grad()
def run_plain_loop(adapter, models, requests: list[EngineRequest]) -> None:
    """One call of a plain denoising loop over the rows of `requests` stacked into one batch
    (flow_grpo's pipeline call on a group); the requests share steps and sampler."""
    first = requests[0].request.sampling
    shapes = [adapter.codec.state_shape(r.request.sampling) for r in requests]
    seeds = [r.request.sampling.seeds for r in requests]
    x = torch.cat([initial_noise(s, shape) for s, shape in zip(seeds, shapes)])
    cond = Condition.cat([r.cond.expand_rows(len(s)) for r, s in zip(requests, seeds)])
    guidance = Guidance.none(x.shape[0])
    sigmas = adapter.sigmas(first)
    for j in range(first.num_steps):
        sigma = sigmas[j].expand(x.shape[0])
        kind = first.sampler if uses_sde(j, first.window) else SamplerKind.ODE
        noise = (torch.cat([row_noise(s, j, shape) for s, shape in zip(seeds, shapes)])
                 if kind != SamplerKind.ODE else None)
        x = denoise_step(adapter.denoiser, models, x, sigma, sigmas[j + 1].expand(x.shape[0]),
                         cond, guidance, kind, first.noise_level, noise).prev_sample


def run_one_at_a_time(adapter, models, requests: list[EngineRequest]) -> None:
    for r in requests:
        run_plain_loop(adapter, models, [r])


def measure_interleaved(runners: dict, repeats: int) -> dict[str, float]:
    """Median seconds per mode; the modes take turns in every round (after one warm-up each),
    so a shared machine's changing load falls on all of them alike."""
    for fn in runners.values():
        fn()
    times: dict[str, list[float]] = {mode: [] for mode in runners}
    for _ in range(repeats):
        for mode, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) for mode, t in times.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(result["samples_per_s"])
    colors = [f"C{i}" for i in range(len(modes))]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.bar(modes, [result["samples_per_s"][m] for m in modes], color=colors)
    ax1.set_ylabel("samples / s")
    ax1.set_title(f"all {result['requests']} arrive together, {result['steps']} steps: "
                  f"vs static x{result['vs_static_batch']:.2f}", fontsize=9)
    ax1.tick_params(axis="x", labelrotation=20)
    staggered = result["staggered"]
    policies = list(staggered["policies"])
    ax2.bar(policies, [staggered["policies"][p]["samples_per_s"] for p in policies],
            color=["C0", "C2", "C3"])
    ax2.set_ylabel("samples / s")
    ax2.set_title(f"Poisson arrivals, {staggered['rate_per_s']:.1f} req/s offered", fontsize=9)
    for i, q in enumerate(("latency_p50_s", "latency_p95_s")):
        ax3.bar([j + 0.4 * i for j in range(len(policies))],
                [staggered["policies"][p][q] for p in policies], width=0.4,
                label=q.replace("latency_", "").replace("_s", ""))
    ax3.set_xticks([j + 0.2 for j in range(len(policies))], policies)
    ax3.set_ylabel("latency (s)")
    ax3.legend(fontsize=8)
    ax3.set_title("latency under staggered arrivals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def staggered(engine, adapter, components, requests, rate_per_s: float, seed: int) -> dict:
    """The three policies on the same Poisson arrival times and requests."""
    arrivals = poisson_arrivals(len(requests), rate_per_s, seed)
    plain = lambda batch: run_plain_loop(adapter, components, batch)  # noqa: E731
    return {"rate_per_s": rate_per_s, "seed": seed, "requests": len(requests),
            "policies": {
                "stepwise": serve_stepwise(engine, requests, arrivals),
                "static_batch": serve_batched(plain, requests, arrivals, len(requests)),
                "one_at_a_time": serve_batched(plain, requests, arrivals, 1)}}


MODES = ("engine_concurrent", "engine_sequential", "static_batch", "one_at_a_time_loop")


def _mode_runner(mode: str, engine, adapter, components, requests):
    return {"engine_concurrent": lambda: run_concurrent(engine, requests),
            "engine_sequential": lambda: run_sequential(engine, requests),
            "static_batch": lambda: run_plain_loop(adapter, components, requests),
            "one_at_a_time_loop": lambda: run_one_at_a_time(adapter, components,
                                                            requests)}[mode]


def memory_in_fresh_process(mode: str, args) -> float:
    """Peak RSS (MiB) above the post-load RSS while `mode` runs once, in its own process, so no
    mode inherits memory another one already grew."""
    cmd = [sys.executable, "-m", "bench.rollout_bench", "--memory-mode", mode,
           "--requests", str(args.requests), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for every mode (default: all cores)")
    parser.add_argument("--arrival-load", type=float, default=0.6,
                        help="offered load of the staggered run, as a fraction of the "
                             "engine's all-together capacity")
    parser.add_argument("--arrival-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    adapter = get_family("tiny_t2i")
    components, weights = adapter.load_transformers(), "shipped"
    requests = _requests(adapter, adapter.load_encoders(), args.requests, args.steps)
    engine = EmbeddedEngine(adapter, components, {}, EngineLimits(max_batch_rows=args.requests))
    if args.memory_mode is not None:               # child process of memory_in_fresh_process
        with PeakRSS() as mem:
            _mode_runner(args.memory_mode, engine, adapter, components, requests)()
        import asyncio
        asyncio.run(engine.shutdown())
        print(mem.mib)
        return {}
    try:
        timings = measure_interleaved({mode: _mode_runner(mode, engine, adapter, components,
                                                          requests) for mode in MODES},
                                      args.repeats)
        rate = args.arrival_load * args.requests / timings["engine_concurrent"]
        arriving = _requests(adapter, adapter.load_encoders(), args.arrival_requests, args.steps)
        stagger = staggered(engine, adapter, components, arriving, rate, args.seed)
    finally:
        import asyncio
        asyncio.run(engine.shutdown())
    sps = {mode: args.requests / seconds for mode, seconds in timings.items()}
    result = {
        "bench": "rollout", "adapter": adapter.name, "weights": weights,
        "requests": args.requests, "rows_per_request": 1, "steps": args.steps,
        "sampler": SamplerKind.SDE.value, "torch_threads": args.threads,
        "repeats": args.repeats, "device": "cpu", "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0],
        "seconds": timings,
        "samples_per_s": sps,
        "peak_rss_mib": {mode: memory_in_fresh_process(mode, args) for mode in timings},
        "peak_rss_note": "peak RSS above the post-load RSS during one run of the mode, each "
                         "mode in its own fresh process",
        "batching_speedup": sps["engine_concurrent"] / sps["engine_sequential"],
        "vs_static_batch": sps["engine_concurrent"] / sps["static_batch"],
        "vs_one_at_a_time_loop": sps["engine_concurrent"] / sps["one_at_a_time_loop"],
        "staggered": stagger,
        "staggered_note": f"Poisson arrivals at {args.arrival_load:g} x the engine's "
                          "all-together capacity, the same times and requests for each policy",
        "goals": {"batching_speedup": 3.0, "vs_one_at_a_time_loop": 1.5},
    }
    result["goals_met"] = {k: result[k] >= v for k, v in result["goals"].items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "rollout.png")
    print(json.dumps({k: result[k] for k in ("weights", "samples_per_s", "batching_speedup",
                                             "vs_static_batch", "vs_one_at_a_time_loop",
                                             "staggered", "peak_rss_mib")}, indent=2))
    return result


if __name__ == "__main__":
    main()
