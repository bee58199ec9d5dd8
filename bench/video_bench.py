"""Video families' rollouts: step-wise batching against one request at a time, object-store bytes
per sample, peak RSS per stage (bench/results/video.json + video.png).

`python -m bench.video_bench [--families ltx2 ...]` runs, per family in CASES (a tiny real-layout
checkpoint written by testing/tiny_checkpoints.py into a temporary folder):

  engine        the embedded engine in this process on the family's transformer: N requests of
                R rows each, all in flight (rows of different requests packed per step) against
                the same engine serving them one at a time; samples/s of each and their ratio,
                same run, median of `repeats` after a warm-up
  graph         the family's Serve config on a local Ray cluster (the checkpoint path filled in):
                a batch of N requests through the handle API, then
                object_store.bytes_per_sample  what the stages put per sample (artifacts by name
                                               + the fp32 window trajectory), from the handles
                object_store.held_mib / after_release_mib   the store's use with the results
                                               held by the caller / once fetched and released,
                                               against the baseline before the batch
                peak_rss_mib    each stage replica's peak resident memory (VmHWM) after the batch

Adding a family = one `VideoCase` in CASES: registry name, tiny checkpoint, options,
sampling, prompts, Serve config and how to fill in its run-time paths.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ("a red ball bouncing with loud beeps", "a green square sliding with a hum",
           "a blue cube falling with clicks", "a yellow star spinning with a whistle")
SHAPE_PROMPTS = ("a red circle in the center on a white background",     # what the shape
                 "a green triangle at the top left on a white background",  # verifier reads
                 "a green square at the bottom left on a gray background",
                 "a blue triangle at the bottom right on a white background")


@dataclass(frozen=True)
class VideoCase:
    family: str                           # registry name
    checkpoint: str                       # testing/tiny_checkpoints.py family
    options: dict
    sampling: dict                        # SamplingSpec fields besides seeds / sampler
    graph: str                            # Serve config (configs/*.yaml)
    negative: str | None = "blurry"
    graph_args: Callable[[dict, Path, Path], dict] | None = None   # (args, ckpt, tmp) -> args
    notes: str = ""
    prompts: tuple[str, ...] = PROMPTS


def _wan_graph(args: dict, root: Path, tmp: Path) -> dict:
    """configs/wan_tiny.yaml with the checkpoint (the shape verifier on 3 sampled frames)."""
    args["rollout"]["weights_path"] = str(root)
    return args


def _ltx2_graph(args: dict, root: Path, tmp: Path) -> dict:
    """configs/ltx2_tiny.yaml with the checkpoint, scored by AV-sync only (CLAP / ImageBind need
    snapshot dirs and add nothing to what this bench measures)."""
    args["rollout"]["weights_path"] = str(root)
    args["scorers"] = [s for s in args["scorers"] if s["name"] == "av_sync"]
    return args


CASES: dict[str, VideoCase] = {
    "wan21": VideoCase(
        family="wan", checkpoint="wan21", options={"max_sequence_length": 64},
        sampling={"height": 32, "width": 48, "num_frames": 9, "guidance_scale": 5.0},
        graph="configs/wan_tiny.yaml", graph_args=_wan_graph, prompts=SHAPE_PROMPTS,
        notes="Wan 2.1 T2V layout, random weights; CFG rows doubled; 9 frames (3 latent)"),
    "wan22": VideoCase(
        family="wan", checkpoint="wan22", options={"max_sequence_length": 64},
        sampling={"height": 32, "width": 48, "num_frames": 9, "guidance_scale": 5.0},
        graph="configs/wan_tiny.yaml", graph_args=_wan_graph, prompts=SHAPE_PROMPTS,
        notes="Wan 2.2 T2V layout (two experts switched at boundary_ratio), random weights; "
              "CFG rows doubled; 9 frames"),
    "ltx2": VideoCase(
        family="ltx2", checkpoint="ltx2",
        options={"max_sequence_length": 64, "frame_rate": 25.0},
        sampling={"height": 64, "width": 96, "num_frames": 9, "guidance_scale": 3.0},
        graph="configs/ltx2_tiny.yaml", graph_args=_ltx2_graph,
        notes="LTX-2.0 layout, random weights; CFG rows doubled; 9 frames at 25 fps + 24 kHz "
              "stereo"),
}


# ---- engine: step-wise batching vs one request at a time -----------------------------------
def _engine_requests(fam, encoders, n: int, rows: int, case: VideoCase, steps: int,
                     seed: int):
    from contract import RequestLimits, RolloutRequest, SamplerKind, SamplingSpec
    from diffusion.step import doubles_rows
    from rollout.engine_api import EngineRequest
    out = []
    for i in range(n):
        negatives = None if case.negative is None else [case.negative]
        bundle = fam.conditioner.tokenize([case.prompts[i % len(case.prompts)]], negatives)[0]
        sampling = SamplingSpec(sampler=SamplerKind.SDE, noise_level=0.7, num_steps=steps,
                                seeds=tuple(seed + i * rows + j for j in range(rows)),
                                **case.sampling)
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=next(iter(fam.spec.tasks)),
                                 request_id=f"bench-{seed}-{i}")
        media = fam.validate_request(request, RequestLimits())
        cond = fam.conditioner.encode(encoders, [bundle])
        negative = fam.conditioner.encode(encoders, [fam.conditioner.unconditional(bundle)]) \
            if doubles_rows(fam.spec.guidance, sampling.guidance_scale) else None
        latents = fam.io_spec.latent_needed(fam.io_spec.defaults)
        out.append(EngineRequest(request, cond, negative, latents, media, "base"))
    return out


def bench_engine(fam, n: int, rows: int, steps: int, repeats: int, case: VideoCase) -> dict:
    from rollout.config import EngineLimits
    from rollout.engine import EmbeddedEngine
    encoders = fam.load_encoders()
    engine = EmbeddedEngine(fam, fam.load_transformers(), fam.load_media_encoders(),
                            EngineLimits(max_batch_rows=max(n * rows, 1)))
    try:
        def stepwise(seed):
            futures = [engine.submit(r) for r in _engine_requests(fam, encoders, n, rows, case,
                                                                  steps, seed)]
            t0 = time.perf_counter()
            results = [f.result(timeout=3600) for f in futures]
            return time.perf_counter() - t0, results

        def one_at_a_time(seed):
            requests = _engine_requests(fam, encoders, n, rows, case, steps, seed)
            t0 = time.perf_counter()
            results = [engine.submit(r).result(timeout=3600) for r in requests]
            return time.perf_counter() - t0, results

        stepwise(10_000)                                                      # warm-up
        times = {"stepwise": [], "one_at_a_time": []}
        for k in range(repeats):
            for mode, run in (("stepwise", stepwise), ("one_at_a_time", one_at_a_time)):
                seconds, results = run(20_000 + 1000 * k)
                times[mode].append(seconds)
                if mode == "stepwise":
                    packed = max(m for r in results for m in [r.metrics["batch_rows_max"]])
        samples = n * rows
        out = {mode: {"seconds_median": statistics.median(t),
                      "samples_per_s": samples / statistics.median(t)}
               for mode, t in times.items()}
        out["batching_speedup"] = out["stepwise"]["samples_per_s"] / \
            out["one_at_a_time"]["samples_per_s"]
        out["stepwise_rows_per_forward_max"] = packed
        return out
    finally:
        import asyncio
        asyncio.run(engine.shutdown())


# ---- graph: object store and stage memory ----------------------------------------------------
def store_usage() -> tuple[float, int]:
    """(MiB, objects) in the object store (`ray memory --stats-only`)."""
    import ray
    from ray._private.internal_api import memory_summary
    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if not found:
        raise RuntimeError(f"unexpected memory summary: {text[:400]}")
    return float(found.group(1)), int(found.group(2))


def stage_peak_rss(app: str) -> dict[str, float]:
    """Peak RSS (VmHWM, MiB) of every replica of the app, by deployment (max over replicas)."""
    from ray._private.state import actors         # the GCS actor table (no dashboard needed)

    from deployments.memory import process_memory
    out: dict[str, float] = {}
    for info in actors().values():
        name = info["ActorClassName"] or ""
        if info["State"] != "ALIVE" or not name.startswith(f"ServeReplica:{app}:"):
            continue
        stage = name.split(":", 2)[2]
        peak = process_memory(info["Pid"])["peak_rss_bytes"] / 2**20
        out[stage] = max(out.get(stage, 0.0), peak)
    return dict(sorted(out.items()))


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if hasattr(value, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


def bench_graph(case: VideoCase, root: Path, tmp: Path, n: int, rows: int, steps: int) -> dict:
    import ray
    from ray import serve

    from adapters.registry import get_family
    from contract import RolloutRequest, SamplerKind, SamplingSpec
    from deployments.client import RolloutClient, materialize
    from graph import build_app
    with open(case.graph) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    app = f"video_bench_{case.checkpoint}"
    args = (case.graph_args or (lambda a, r, t: a))(args, root, tmp)
    args.update(app_name=app, policy_store=f"{app}_store")
    handle = serve.run(build_app(args), name=app, route_prefix=None)
    fam = get_family(case.family, root, case.options)
    client = RolloutClient(handle)

    def requests(seed):
        out = []
        for i in range(n):
            negatives = None if case.negative is None else [case.negative]
            bundle = fam.conditioner.tokenize([case.prompts[i % len(case.prompts)]], negatives)[0]
            out.append(RolloutRequest(prompt=bundle, task=next(iter(fam.spec.tasks)),
                                      sampling=SamplingSpec(
                                          sampler=SamplerKind.SDE, noise_level=0.7,
                                          num_steps=steps,
                                          seeds=tuple(seed + i * rows + j for j in range(rows)),
                                          **case.sampling)))
        return out
    try:
        client.rollout(requests(1))                                 # warm every stage
        gc.collect()
        time.sleep(1.0)
        baseline = store_usage()
        results = handle.rollout.remote(requests(100)).result()     # the caller holds them
        held = store_usage()
        by_artifact: dict[str, int] = {}
        trajectory = 0
        for result in results:
            for name, h in result.artifacts.items():
                by_artifact[name] = by_artifact.get(name, 0) + int(h.nbytes_hint)
            trajectory += _tensor_bytes(ray.get(result.trajectory))
        outputs = [materialize(r) for r in results]
        handle.release.remote([r.request_id for r in results]).result()
        del outputs, results
        gc.collect()
        deadline = time.monotonic() + 30
        while store_usage()[1] > baseline[1] and time.monotonic() < deadline:
            time.sleep(0.5)
        after = store_usage()
        samples = n * rows
        return {
            "object_store": {
                "bytes_per_sample": (sum(by_artifact.values()) + trajectory) / samples,
                "artifact_bytes_per_sample": {k: v / samples for k, v in by_artifact.items()},
                "trajectory_bytes_per_sample": trajectory / samples,
                "baseline": {"mib": baseline[0], "objects": baseline[1]},
                "held": {"mib": held[0], "objects": held[1]},
                "after_release": {"mib": after[0], "objects": after[1]}},
            "peak_rss_mib": stage_peak_rss(app)}
    finally:
        serve.delete(app)


# ---- report ----------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["families"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, name in enumerate(names):
        eng = report["families"][name]["engine"]
        axes[0].bar([i - 0.2, i + 0.2], [eng["stepwise"]["samples_per_s"],
                                          eng["one_at_a_time"]["samples_per_s"]], width=0.4,
                    color=["tab:blue", "tab:gray"])
        axes[0].text(i, eng["stepwise"]["samples_per_s"], f"x{eng['batching_speedup']:.2f}",
                     ha="center", va="bottom")
        store = report["families"][name]["graph"]["object_store"]
        axes[1].bar(i, store["bytes_per_sample"] / 2**10, color="tab:green")
        rss = report["families"][name]["graph"]["peak_rss_mib"]
        axes[2].barh([f"{name}:{k}" for k in rss], list(rss.values()), color="tab:orange")
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_title("samples/s: step-wise batching (blue) vs one at a time")
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set_title("object-store KiB per sample")
    axes[2].set_title("peak RSS per stage (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import ray

    from adapters.registry import get_family
    from testing.tiny_checkpoints import build
    report = {"config": {k: getattr(args, k) for k in ("requests", "rows", "steps", "repeats",
                                                       "threads")},
              "machine": {"cpus": __import__("os").cpu_count(),
                          "torch_threads": torch.get_num_threads()},
              "families": {}}
    with tempfile.TemporaryDirectory(prefix="video_bench-") as tmp:
        tmp = Path(tmp)
        ray.init(address="local", num_cpus=8, object_store_memory=512 * 2**20,
                 include_dashboard=False, log_to_driver=False, namespace="omni-bench")
        try:
            for name in args.families:
                case = CASES[name]
                root = build(case.checkpoint, tmp / "ckpt")
                fam = get_family(case.family, root, case.options)
                entry = {"notes": case.notes, "sampling": case.sampling,
                         "engine": bench_engine(fam, args.requests, args.rows, args.steps,
                                                args.repeats, case),
                         "graph": bench_graph(case, root, tmp, args.requests, args.rows,
                                              args.steps)}
                report["families"][name] = entry
                print(json.dumps({name: entry}, indent=2), flush=True)
        finally:
            ray.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "video.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, RESULTS / "video.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
