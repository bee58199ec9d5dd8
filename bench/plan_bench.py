"""The planner's prediction check on this machine: per-stage costs measured with each stage alone,
the graph's throughput predicted from them (bench/plan.py) at two stage mixes, then measured.

    python -m bench.plan_bench [--clients 6] [--samples 4] [--steps 8] [--seconds 40]

1. Single-stage costs (measured again before each mix, with its graph deployed and idle, so a
   shared machine's load is the same for both), in this process, one torch thread each (what a replica with num_cpus <= 1
   runs), with the classes the deployments use: encoder per request; the rollout strategy with
   `clients` requests in flight (rows packed per step, as the graph's engine sees them) per
   sample; decoder and scorer per sample; the rollout stage once more as two processes at once
   -> the cores this machine really gives two busy replicas (the shared pool).
   The graph's own CPU per request (`graph_overhead`: hops, serialisation, the ingress, Ray's
   processes): the deployed graph's machine-wide busy core-seconds per request, one request at
   a time, minus the same stages' CPU seconds in one process.
   Written to bench/results/stage_costs.json (the planner's default CPU cost file).
2. For each mix (DiTRollout x1, then x2; every other stage x1): the prediction
   min(replicas / cost per stage, pool / (sum of costs + the graph's own per sample)), then
   the graph deployed on a local Ray
   cluster under `clients` closed-loop clients for `seconds`, samples/s measured.
Writes bench/results/plan_check.json + plan_check.png; `within_tolerance` is |pred/meas - 1|
<= 0.25 for both mixes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.demo import RAY_ENV

for key, value in RAY_ENV.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
APP = "plan_check"
TOLERANCE = 0.25
OVERHEAD_REQUESTS = 12          # sequential requests measuring the graph's own CPU cost
PROMPTS = ("a red circle at the top left on a black background",
           "a blue square in the center on a white background",
           "a green triangle at the bottom right on a black background")


def graph_config(steps: int, samples: int, rollout_replicas: int) -> dict:
    one = {"num_cpus": 0.25}
    return {"app_name": APP,
            "rollout": {"adapter": "tiny_t2i", "limits": {"max_batch_rows": 64}},
            "encoder": dict(one), "decoder": dict(one), "ingress": dict(one),
            "rollout_stage": {"num_cpus": 1.0, "num_replicas": rollout_replicas,
                              "max_ongoing_requests": 32},
            "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                         "inputs": ["image"], "reward": {"policy": "required"},
                         "stage": dict(one)}],
            "limits": {"max_prompts": 4, "max_samples_per_prompt": samples,
                       "max_steps": steps, "max_height": 32, "max_width": 32,
                       "max_frames": 1},
            "policy_store": "plan_check_store"}


def requests(family, n: int, steps: int, samples: int, tag: str):
    from contract import RolloutRequest, SamplingSpec, Task
    bundles = family.conditioner.tokenize(list(PROMPTS))
    return [RolloutRequest(prompt=bundles[i % len(bundles)], task=Task.T2I,
                           request_id=f"{tag}-{i}",
                           sampling=SamplingSpec(num_steps=steps,
                                                 seeds=tuple(range(i * samples,
                                                                   (i + 1) * samples))))
            for i in range(n)]


# ---- 1. single-stage costs --------------------------------------------------------------------
def _encoder_and_strategy(steps: int, samples: int):
    """(config, family, encoder, strategy) of the checked graph, built in this process with
    the classes the deployments use, one torch thread (a replica with num_cpus <= 1)."""
    from adapters.registry import get_family
    from deployments.config import load_graph_config
    from deployments.encoder import TextEncoderServer
    from rollout.strategy import build_strategy
    torch.set_num_threads(1)
    config = load_graph_config(graph_config(steps, samples, 1))
    return (config, get_family("tiny_t2i"),
            TextEncoderServer(config.adapter, config.weights_path, 1, "cpu"),
            build_strategy(config.rollout, config.limits))


def _score(scorer, request, image, samples: int):
    from rewards.base import ScoreRequest
    return scorer.score(ScoreRequest(artifacts={"image": image},
                                     prompts=(request.prompt.text,) * samples,
                                     metadata=tuple({"seed": s} for s in request.sampling.seeds)))


def measure_stages(clients: int, steps: int, samples: int, rounds: int) -> dict:
    """Seconds of one stage alone: encoder per request, the others per sample."""
    from deployments.decoder import DecoderServer
    from rewards.registry import build_scorer
    config, family, encoder, strategy = _encoder_and_strategy(steps, samples)
    decoder = DecoderServer(config.adapter, config.weights_path, "image_latent",
                            config.http.max_preview_pixels)
    scorer = build_scorer(config.scorers[0].scorer)
    loop = asyncio.new_event_loop()
    enc_s, roll_s, dec_s, score_s = [], [], [], []
    try:
        for r in range(rounds + 1):                      # round 0 warms up
            batch = requests(family, clients, steps, samples, f"m{r}")
            t0 = time.perf_counter()
            conds = [loop.run_until_complete(encoder.encode([q.prompt])) for q in batch]
            t1 = time.perf_counter()
            outs = loop.run_until_complete(_all(strategy, batch, conds))
            t2 = time.perf_counter()
            images = [decoder._decode(o.artifacts["image_latent"], [decoder.outputs[0]],
                                      q.request_id, q.sampling)[0] for q, o in zip(batch, outs)]
            t3 = time.perf_counter()
            for q, image in zip(batch, images):
                _score(scorer, q, image, samples)
            t4 = time.perf_counter()
            if r:
                rows = clients * samples
                enc_s.append((t1 - t0) / clients)
                roll_s.append((t2 - t1) / rows)
                dec_s.append((t3 - t2) / rows)
                score_s.append((t4 - t3) / rows)
        # the same stages, one request at a time: the process's CPU seconds per request
        # (engine thread included), to subtract from the graph's for its own overhead
        batch = requests(family, OVERHEAD_REQUESTS, steps, samples, "cpu")
        cpu0 = time.process_time()
        for q in batch:
            cond = loop.run_until_complete(encoder.encode([q.prompt]))
            [out] = loop.run_until_complete(_all(strategy, [q], [cond]))
            [image] = decoder._decode(out.artifacts["image_latent"], [decoder.outputs[0]],
                                      q.request_id, q.sampling)
            _score(scorer, q, image, samples)
        stages_cpu_s = (time.process_time() - cpu0) / len(batch)
    finally:
        loop.run_until_complete(strategy.engine.shutdown())
        loop.close()
    med = statistics.median
    return {"in_process_core_seconds_per_request": stages_cpu_s,
            "encoder": {"seconds_per_request": med(enc_s)},
            "rollout": {"seconds_per_sample": med(roll_s), "batch_rows": clients * samples},
            "decoder:image_latent": {"seconds_per_sample": med(dec_s)},
            "scorer:image_attributes": {"seconds_per_sample": med(score_s)}}


async def _all(strategy, batch, conds) -> list:
    """All requests in flight at once: the engine packs their rows into each step."""
    return list(await asyncio.gather(*(strategy.generate(q, c, None)
                                       for q, c in zip(batch, conds))))


def rollout_alone(clients: int, steps: int, samples: int, rounds: int) -> float:
    """Wall seconds of `rounds` packed rollout rounds in this process (one thread)."""
    _, family, encoder, strategy = _encoder_and_strategy(steps, samples)
    loop = asyncio.new_event_loop()
    batch = requests(family, clients, steps, samples, "p")
    conds = [loop.run_until_complete(encoder.encode([q.prompt])) for q in batch]
    loop.run_until_complete(_all(strategy, batch, conds))
    t0 = time.perf_counter()
    for _ in range(rounds):
        loop.run_until_complete(_all(strategy, batch, conds))
    seconds = time.perf_counter() - t0
    loop.run_until_complete(strategy.engine.shutdown())
    loop.close()
    return seconds


def effective_cores(clients: int, steps: int, samples: int, rounds: int) -> float:
    """Two rollout processes at once vs one alone: the parallelism two busy replicas get."""
    def run(n: int) -> list[float]:
        cmd = [sys.executable, "-m", "bench.plan_bench", "--rollout-alone", str(rounds),
               "--clients", str(clients), "--steps", str(steps), "--samples", str(samples)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        return [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    ratios = []
    for _ in range(3):                         # the median of three: a shared machine is noisy
        [alone] = run(1)
        ratios.append(2 * alone / max(run(2)))
    return min(statistics.median(ratios), float(os.cpu_count() or 1))


def busy_core_seconds() -> float:
    """Core-seconds this machine has been busy (every process: /proc/stat, not idle/iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def graph_core_seconds(handle, family, steps: int, samples: int) -> float:
    """Machine-wide busy core-seconds per request of the deployed graph, one request at a time
    (after one warm-up request)."""
    from deployments.client import RolloutClient
    client = RolloutClient(handle)
    batch = requests(family, OVERHEAD_REQUESTS + 1, steps, samples, "overhead")
    client.rollout(batch[:1])
    busy0 = busy_core_seconds()
    for q in batch[1:]:
        client.rollout([q])
    return (busy_core_seconds() - busy0) / OVERHEAD_REQUESTS


# ---- 2. the graph at two mixes -----------------------------------------------------------------
def measure_graph(handle, family, clients: int, steps: int, samples: int,
                  seconds: float) -> dict:
    """Closed loop: `clients` threads, one request each in flight, for `seconds` after a
    warm-up round; samples/s of the requests completed in the window."""
    from deployments.client import RolloutClient
    client = RolloutClient(handle)
    stop, done, errors = threading.Event(), [], []
    window = {}

    def worker(w: int) -> None:
        n = 0
        while not stop.is_set():
            [q] = requests(family, 1, steps, samples, f"w{w}-{n}")
            try:
                client.rollout([q])
            except Exception as exc:  # noqa: BLE001 -- reported, fails the check
                errors.append(repr(exc))
                return
            done.append(time.perf_counter())
            n += 1
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    time.sleep(min(10.0, seconds / 3))                   # warm-up: queues and batches settle
    window["start"] = time.perf_counter()
    start_count = len(done)
    time.sleep(seconds)
    window["end"] = time.perf_counter()
    count = len(done) - start_count
    stop.set()
    for t in threads:
        t.join(timeout=300)
    return {"samples_per_s": count * samples / (window["end"] - window["start"]),
            "requests": count, "errors": errors[:3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rollout-alone", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-costs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rollout_alone is not None:                  # child of effective_cores
        print(rollout_alone(args.clients, args.steps, args.samples, args.rollout_alone))
        return 0
    if args.measure_costs:                              # child of measure_costs
        print(json.dumps(measure_stages(args.clients, args.steps, args.samples, args.rounds)))
        return 0
    import ray
    from ray import serve

    from adapters.registry import get_family
    from bench.plan import StageCost, graph_overhead_per_sample, predict, stage_costs
    from deployments.config import load_graph_config
    from graph import build_app

    def measure_costs() -> dict:
        """Single-stage costs and the shared pool, measured just before a graph run (the
        machine may be shared: both then see the same load), in a process of their own."""
        cmd = [sys.executable, "-m", "bench.plan_bench", "--measure-costs", "--clients",
               str(args.clients), "--steps", str(args.steps), "--samples", str(args.samples),
               "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        stages = json.loads(out.strip().splitlines()[-1])
        in_process = stages.pop("in_process_core_seconds_per_request")
        graph = graph_core_seconds(handle, family, args.steps, args.samples)
        return {"what": "tiny_t2i stages on this machine's CPU, each alone, one torch thread",
                "source": "measured (bench/plan_bench.py)", "device_kind": "CPU",
                "samples_per_request": args.samples, "cpu_count": os.cpu_count(),
                "stages": stages,
                # the graph's own CPU per request: the deployed graph's machine-wide busy
                # core-seconds per request minus the same stages' in one process
                "graph_overhead": {"core_seconds_per_request": graph - in_process,
                                   "graph_core_seconds_per_request": graph,
                                   "in_process_core_seconds_per_request": in_process},
                "pool_cores": effective_cores(args.clients, args.steps, args.samples,
                                              args.rounds)}
    # The ingress (validation, the DAG's hops) has no single-stage figure: it is part of the
    # graph's own CPU per request (`graph_overhead`, measured apart, one request at a time),
    # which shares the pool with the stages' compute.
    family = get_family("tiny_t2i")
    mixes = []
    ray.init(address="local", num_cpus=8, object_store_memory=256 * 2**20,
             include_dashboard=False, log_to_driver=False, namespace="omni-plan")
    serve.start(proxy_location="Disabled")
    try:
        for rollout_replicas in (1, 2):
            config = load_graph_config(graph_config(args.steps, args.samples, rollout_replicas))
            handle = serve.run(build_app(config), name=APP, route_prefix=None)
            costs = measure_costs()
            planned: list[StageCost] = stage_costs(config, costs, skip=("ingress",))
            replicas = {s.key: (rollout_replicas if s.key == "rollout" else 1) for s in planned}
            predicted, bottleneck, limited = predict(planned, replicas, costs["pool_cores"],
                                                     graph_overhead_per_sample(costs))
            measured = measure_graph(handle, family, args.clients, args.steps, args.samples,
                                     args.seconds)
            serve.delete(APP)
            mixes.append({"replicas": {"DiTRollout": rollout_replicas, "others": 1},
                          "stage_costs": costs["stages"], "pool_cores": costs["pool_cores"],
                          "graph_overhead": costs["graph_overhead"],
                          "predicted_samples_per_s": predicted, "bottleneck": bottleneck,
                          "limited_by": limited, **{f"measured_{k}": v
                                                    for k, v in measured.items()},
                          "ratio": predicted / measured["samples_per_s"]
                          if measured["samples_per_s"] else None})
            print(json.dumps(mixes[-1]))
    finally:
        serve.shutdown()
        ray.shutdown()
    within = all(m["ratio"] is not None and abs(m["ratio"] - 1) <= TOLERANCE and
                 not m["measured_errors"] for m in mixes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stage_costs.json").write_text(json.dumps(costs, indent=2) + "\n")
    result = {"what": "planner prediction vs measured graph throughput, tiny_t2i on CPU",
              "clients": args.clients, "samples_per_request": args.samples,
              "steps": args.steps, "seconds": args.seconds,
              "mixes": mixes, "tolerance": TOLERANCE,
              "within_tolerance": within, "cpu_count": os.cpu_count(),
              "load_avg_1m_at_end": os.getloadavg()[0]}
    (args.out / "plan_check.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "plan_check.png")
    print(json.dumps({"within_tolerance": within,
                      "ratios": [round(m["ratio"], 3) for m in mixes if m["ratio"]]}))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"DiTRollout x{m['replicas']['DiTRollout']}\n({m['limited_by']})"
              for m in result["mixes"]]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [m["predicted_samples_per_s"] for m in result["mixes"]],
           width=0.4, label="predicted (single-stage costs)")
    ax.bar([i + 0.2 for i in x], [m["measured_samples_per_s"] for m in result["mixes"]],
           width=0.4, label="measured (graph)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("samples / s")
    ax.set_title(f"planner check: within {result['tolerance']:.0%}: {result['within_tolerance']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
