"""Rollout throughput: step-wise batching engine vs one-at-a-time vs a plain per-request loop.

`python -m bench.rollout_bench` measures, side by side in one run on tiny_t2i (shipped weights if
present, else the same architecture with seeded random weights; recorded as "weights"):

  engine_concurrent  the embedded engine with N requests in flight (packed per step)
  engine_sequential  the same engine, one request at a time (same steps, same sampler)
  diffusers_loop     per request: the diffusers training-form transformer + our SDE step with
                     log-prob, no batching across requests

and writes bench/results/rollout.json and bench/results/rollout.png.
batching_speedup = concurrent / sequential samples/s; vs_diffusers_loop = concurrent / loop.
Peak memory per mode: peak RSS above the post-load RSS (sampled every 2 ms) during one run of
the mode, each mode in its own fresh process.
Each mode is run `repeats` times after a warm-up; the median time is reported.
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
from contract import RolloutRequest, SamplerKind, SamplingSpec, Task
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
def run_diffusers_loop(adapter, models, requests: list[EngineRequest]) -> None:
    """The baseline: one request after another, a plain loop of the denoising step."""
    for r in requests:
        sampling = r.request.sampling
        shape = adapter.codec.state_shape(sampling)
        sigmas = adapter.sigmas(sampling)
        x = initial_noise(sampling.seeds, shape)
        cond = r.cond.expand_rows(x.shape[0])
        guidance = Guidance.none(x.shape[0])
        for j in range(sampling.num_steps):
            sigma = sigmas[j].expand(x.shape[0])
            kind = sampling.sampler if uses_sde(j, sampling.window) else SamplerKind.ODE
            noise = row_noise(sampling.seeds, j, shape) if kind != SamplerKind.ODE else None
            x = denoise_step(adapter.denoiser, models, x, sigma, sigmas[j + 1].expand(x.shape[0]),
                             cond, guidance, kind, sampling.noise_level, noise).prev_sample


def measure(fn, repeats: int) -> float:
    """Median seconds over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(result["samples_per_s"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(modes, [result["samples_per_s"][m] for m in modes], color=["C0", "C1", "C2"])
    ax1.set_ylabel("samples / s")
    ax1.set_title(f"{result['requests']} requests x {result['steps']} steps "
                  f"({result['weights']} weights)")
    ax1.tick_params(axis="x", labelrotation=15)
    ax2.bar(modes, [result["peak_rss_mib"][m] for m in modes], color=["C0", "C1", "C2"])
    ax2.set_ylabel("peak RSS above start (MiB)")
    ax2.set_title(f"batching x{result['batching_speedup']:.2f}, "
                  f"vs loop x{result['vs_diffusers_loop']:.2f}")
    ax2.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mode_runner(mode: str, engine, adapter, components, requests):
    return {"engine_concurrent": lambda: run_concurrent(engine, requests),
            "engine_sequential": lambda: run_sequential(engine, requests),
            "diffusers_loop": lambda: run_diffusers_loop(adapter, components, requests)}[mode]


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
        timings = {mode: measure(_mode_runner(mode, engine, adapter, components, requests),
                                 args.repeats)
                   for mode in ("engine_concurrent", "engine_sequential", "diffusers_loop")}
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
        "vs_diffusers_loop": sps["engine_concurrent"] / sps["diffusers_loop"],
        "goals": {"batching_speedup": 3.0, "vs_diffusers_loop": 1.5},
    }
    result["goals_met"] = {k: result[k] >= v for k, v in result["goals"].items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "rollout.png")
    print(json.dumps({k: result[k] for k in ("weights", "samples_per_s", "batching_speedup",
                                             "vs_diffusers_loop", "peak_rss_mib")}, indent=2))
    return result


if __name__ == "__main__":
    main()
