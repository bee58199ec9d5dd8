"""Graph overhead and ingress bytes: the tiny_t2i graph on a local Ray cluster vs the same stage
code in-process, same batch, measured side by side (alternating) in one run.

    python -m bench.graph_bench [--iters 8] [--steps 8] [--samples 4]

graph_overhead = median end-to-end time through the graph (ingress handle call + fetching the
outputs from the object store) / median time of encoder -> strategy.generate -> decode -> score
in this process with the classes the deployments use (TextEncoderServer, DiffusionStrategy,
DecoderServer._decode, the registry's scorer + RewardCombiner; the encoder with the graph's
prompt-embedding cache, as its stage has it). Both run one torch thread, as a
replica with num_cpus < 1 does.
fixed_cost_per_request_ms = graph median - in-process median, and `breakdown`: where it goes,
from each result's metrics (the ingress's wall seconds per hop, `ingress_*_s`, beside the
stages' own compute seconds inside their replicas) and the caller's handle call / fetch.
`variants`: the same with the scorer's micro-batch wait at the old 10 ms (a lone request waited
it out), and with the encoder's and decoders' micro-batch wait at 2 ms instead of 0;
`at_training_size`: the same deployed graph at a group of 16 x 20 steps.
`burst`: 8 concurrent guided requests with fresh prompts (16 encoder calls: prompts and
negatives): their wall time and the encoder forwards / decoder batch rows they took -- what the
encoder / decoder micro-batch waits buy under concurrency.
`rpc_floor`: the Serve handle round trip to an empty deployment (from this process, as the
caller reaches the ingress; from a replica, as the ingress reaches a stage) and a Ray actor call
from a replica (the policy store, the object holder), medians in ms; `critical_path` counts those
hops on one request's path, so `floor_ms` is the part of the fixed cost that is RPC alone.
ingress_bytes = tensor bytes that passed through the ingress (its `stats()`), next to the
bytes of the artifacts (and trajectory) delivered to the caller.
Writes bench/results/graph.json + graph.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from trainer.demo import RAY_ENV   # plain settings; importing it starts nothing

for key, value in RAY_ENV.items():
    os.environ.setdefault(key, value)   # before Ray starts, so every worker inherits them

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
APP = "graph_bench"
PROMPT = "a red circle at the top left on a black background"


def graph_config(steps: int) -> dict:
    return {"app_name": APP, "rollout": {"adapter": "tiny_t2i"},
            "rollout_stage": {"num_cpus": 0.5},
            "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                         "inputs": ["image"], "reward": {"policy": "required"}}],
            "limits": {"max_prompts": BURST, "max_samples_per_prompt": 16, "max_steps": max(steps, 20),
                       "max_height": 32, "max_width": 32, "max_frames": 1},
            "policy_store": "graph_bench_store"}


class InProcess:
    """The graph's stage code, called directly: encoder -> strategy -> decoder -> scorer."""

    def __init__(self, config):
        from deployments.decoder import DecoderServer
        from deployments.encoder import TextEncoderServer
        from rewards.combine import RewardCombiner
        from rewards.registry import build_scorer
        from rollout.strategy import build_strategy
        # the graph's encoder stage with its config: the same prompt-embedding cache
        enc = config.encoder
        self.encoder = TextEncoderServer(config.adapter, config.weights_path, enc.etp,
                                         enc.device, enc.dtype, config.adapter_options,
                                         enc.prompt_cache_bytes)
        self.strategy = build_strategy(config.rollout, config.limits)
        self.decoder = DecoderServer(config.adapter, config.weights_path, "image_latent",
                                     config.http.max_preview_pixels)
        self.scorers = {s.name: build_scorer(s.scorer) for s in config.scorers}
        self.combiner = RewardCombiner(config.reward_config)

    async def run(self, request):
        """(image, reward report, seconds per stage)."""
        from rewards.base import ScoreRequest
        t0 = time.perf_counter()
        cond = await self.encoder.encode([request.prompt])
        t1 = time.perf_counter()
        out = await self.strategy.generate(request, cond, None)
        t2 = time.perf_counter()
        latent = out.artifacts["image_latent"]
        [image] = self.decoder._decode(latent, [self.decoder.outputs[0]], request.request_id,
                                       request.sampling)
        t3 = time.perf_counter()
        n = request.sampling.samples_per_prompt
        score_request = ScoreRequest(artifacts={"image": image},
                                     prompts=(request.prompt.text,) * n,
                                     metadata=tuple({"seed": s} for s in request.sampling.seeds))
        outputs = {name: s.score(score_request) for name, s in self.scorers.items()}
        report = self.combiner(outputs, {name: s.primary for name, s in self.scorers.items()})
        t4 = time.perf_counter()
        return image, report, {"encode": t1 - t0, "rollout": t2 - t1, "decode": t3 - t2,
                               "score": t4 - t3}


class Empty:
    """An empty deployment: the Serve handle round trip and nothing else."""

    async def ping(self, x=None):
        return x


class EmptyActor:
    def ping(self, x=None):
        return x


class Relay:
    """Calls the empty deployment / a plain actor from inside a replica, as the ingress and the
    stages do: median round trips in seconds."""

    def __init__(self, inner):
        import ray
        self.inner = inner
        self.actor = ray.remote(EmptyActor).options(num_cpus=0).remote()

    async def hops(self, n: int) -> dict[str, float]:
        await self.inner.ping.remote()
        await self.actor.ping.remote()
        serve_s, actor_s = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await self.inner.ping.remote()
            serve_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await self.actor.ping.remote()
            actor_s.append(time.perf_counter() - t0)
        return {"serve": statistics.median(serve_s), "actor": statistics.median(actor_s)}


def rpc_floor(n: int = 50) -> dict:
    """Round trips with nothing behind them: caller -> replica, replica -> replica, replica ->
    actor (medians, ms), deployed beside the graph's replicas on the same machine."""
    from ray import serve
    opts = {"ray_actor_options": {"num_cpus": 0.1}}
    empty = serve.deployment(Empty, name="Empty", **opts).bind()
    handle = serve.run(serve.deployment(Relay, name="Relay", **opts).bind(empty),
                       name="rpc_floor", route_prefix=None)
    try:
        inner = serve.get_deployment_handle("Empty", "rpc_floor")
        inner.ping.remote().result()
        caller = []
        for _ in range(n):
            t0 = time.perf_counter()
            inner.ping.remote().result()
            caller.append(time.perf_counter() - t0)
        inside = handle.hops.remote(n).result()
    finally:
        serve.delete("rpc_floor")
    return {"caller_to_replica_ms": statistics.median(caller) * 1e3,
            "replica_to_replica_ms": inside["serve"] * 1e3,
            "replica_to_actor_ms": inside["actor"] * 1e3, "calls": n}


# sequential round trips on one 1 x 4 x 8 request's critical path (tiny_t2i, one scorer with a
# prompt check, no CFG): which kind each is (deployments/ingress.py, rollout.py, decoder.py)
CRITICAL_PATH = {
    "caller_to_replica": ("caller -> ingress.rollout",),
    "replica_to_replica": ("ingress -> scorer.check_prompts", "ingress -> encoder.encode",
                           "ingress -> rollout.rollout", "ingress -> decoder.decode",
                           "ingress -> scorer.score"),
    "replica_to_actor": ("rollout -> policy_store.latest_version", "rollout -> holder.hold",
                         "decoder -> holder.hold"),
}   # no holder.release: every artifact is requested (ingress_release_s ~ 0), none internal


def floor_of(floor: dict) -> dict:
    per = {kind: len(hops) * floor[f"{kind}_ms"] for kind, hops in CRITICAL_PATH.items()}
    return {"hops": {k: list(v) for k, v in CRITICAL_PATH.items()}, "ms_by_kind": per,
            "floor_ms": sum(per.values())}


BURST = 8


def burst(handle, make, rounds: int = 3) -> dict:
    """BURST concurrent guided requests with prompts the encoder has not seen (so each encodes:
    BURST prompts + their negatives); wall time and the encoder's forwards / rows per round."""
    from ray import serve

    from deployments.client import materialize
    encoder = serve.get_deployment_handle("TextEncoder", APP)
    walls, forwards, rows = [], [], []
    for r in range(rounds):
        before = encoder.cache_stats.remote().result()
        t0 = time.perf_counter()
        results = handle.rollout.remote([make(r * BURST + i) for i in range(BURST)]
                                        ).result(timeout_s=600)
        walls.append(time.perf_counter() - t0)
        for result in results:
            materialize(result)
        handle.release.remote([x.request_id for x in results]).result()
        after = encoder.cache_stats.remote().result()
        forwards.append(after["forwards"] - before["forwards"])
        rows.append(after["forward_rows"] - before["forward_rows"])
    return {"requests": BURST, "encoder_calls": 2 * BURST, "wall_s": statistics.median(walls),
            "encoder_forwards": statistics.median(forwards),
            "encoder_forward_rows": statistics.median(rows)}


HOP_KEYS = ("ingress_check_s", "ingress_rollout_s", "rollout_stage_s", "run_time_s",
            "queue_time_s", "ingress_decode_s", "decode_image_latent_s", "score_s",
            "ingress_release_s", "ingress_total_s")


def _round(handle, local: InProcess, loop, request) -> tuple:
    """One graph call (fetching its tensors) then the same request in-process: (the graph's
    output, seconds until its GraphResult, graph seconds, in-process seconds, in-process
    seconds per stage)."""
    from deployments.client import materialize
    t0 = time.perf_counter()
    [result] = handle.rollout.remote(request()).result(timeout_s=600)
    t_call = time.perf_counter() - t0
    out = materialize(result)
    dt_graph = time.perf_counter() - t0
    t0 = time.perf_counter()
    image, report, stage_s = loop.run_until_complete(local.run(request()))
    dt_local = time.perf_counter() - t0
    assert out.artifacts["image"].data.shape == image.data.shape
    assert len(out.rewards.total) == len(report.total) == len(image.data)
    return out, t_call, dt_graph, dt_local, stage_s


def _ratio(handle, local: InProcess, loop, request, iters: int) -> dict:
    """Graph vs in-process at another request size, alternating, on the deployed graph."""
    _round(handle, local, loop, request)                          # warm-up
    graph_s, local_s = zip(*(_round(handle, local, loop, request)[2:4] for _ in range(iters)))
    g, l = statistics.median(graph_s), statistics.median(local_s)
    sampling = request().sampling
    return {"samples_per_prompt": sampling.samples_per_prompt, "num_steps": sampling.num_steps,
            "graph_s": g, "in_process_s": l, "graph_overhead": g / l,
            "fixed_cost_per_request_ms": (g - l) * 1e3}


def measure(config, iters: int, request, local: InProcess, loop,
            larger_requests: dict | None = None, make_burst=None) -> dict:
    """Deploy `config`; alternate graph and in-process calls of the same request; medians."""
    from ray import serve

    from deployments.ingress import tensor_bytes
    from graph import build_app
    t_deploy = time.perf_counter()
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    deploy_s = time.perf_counter() - t_deploy
    graph_s, local_s, call_s, delivered, stages = [], [], [], [], []
    hops: dict[str, list[float]] = {k: [] for k in HOP_KEYS}
    try:
        for i in range(iters + 2):                                # 2 warm-up rounds
            out, t_call, dt_graph, dt_local, stage_s = _round(handle, local, loop, request)
            if i >= 2:
                graph_s.append(dt_graph)
                local_s.append(dt_local)
                call_s.append(t_call)
                stages.append(stage_s)
                delivered.append(tensor_bytes(out.artifacts) + tensor_bytes(out.trajectory))
                for k in HOP_KEYS:
                    hops[k].append(out.metrics[k])
        ingress = handle.stats.remote().result()
        larger = {name: _ratio(handle, local, loop, make, iters // 2)
                  for name, make in (larger_requests or {}).items()}
        bursts = burst(handle, make_burst) if make_burst is not None else None
    finally:
        serve.delete(APP)
    g, l = statistics.median(graph_s), statistics.median(local_s)
    med = {k: statistics.median(v) for k, v in hops.items()}
    stage_compute = (med["run_time_s"] + med["decode_image_latent_s"])
    return {"deploy_s": round(deploy_s, 2), "larger_requests": larger, "burst": bursts,
            "in_process_stage_median_s": {k: statistics.median(s[k] for s in stages)
                                          for k in stages[0]},
            "graph_s": {"median": g, "min": min(graph_s), "max": max(graph_s)},
            "in_process_s": {"median": l, "min": min(local_s), "max": max(local_s)},
            "graph_overhead": g / l, "graph_minus_in_process_ms": (g - l) * 1e3,
            # where a graph call's time goes, medians in ms: the ingress's wall per hop and
            # the stages' own compute inside their replicas; the caller's handle call (until
            # the GraphResult arrives) and its fetch of the tensors from the object store
            "hops_ms": {k: v * 1e3 for k, v in med.items()},
            "caller_handle_call_ms": statistics.median(call_s) * 1e3,
            "caller_fetch_ms": (g - statistics.median(call_s)) * 1e3,
            "handle_call_outside_ingress_ms": (statistics.median(call_s)
                                               - med["ingress_total_s"]) * 1e3,
            "rollout_hop_outside_engine_ms": (med["ingress_rollout_s"] - med["run_time_s"])
            * 1e3,
            "decode_hop_outside_decoder_ms": (med["ingress_decode_s"]
                                              - med["decode_image_latent_s"]) * 1e3,
            "stage_compute_ms": stage_compute * 1e3,
            "ingress_bytes": ingress["ingress_tensor_bytes"],
            "delivered_bytes_per_call": statistics.median(delivered)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)

    import ray
    from ray import serve

    from adapters.registry import get_family
    from contract import RolloutRequest, SamplingSpec, Task
    from deployments.config import load_graph_config

    family = get_family("tiny_t2i")
    bundle = family.conditioner.tokenize([PROMPT])[0]

    def request(samples: int = args.samples, steps: int = args.steps) -> RolloutRequest:
        return RolloutRequest(prompt=bundle, task=Task.T2I, requested_artifacts=(
            "image_latent", "image"), sampling=SamplingSpec(
                num_steps=steps, seeds=tuple(range(samples))))

    def guided(index: int) -> RolloutRequest:      # a fresh caption, CFG: prompt + negative
        from synthetic.shapes import ALL_COMBINATIONS, ImageSpec, caption
        text = caption(ImageSpec(*ALL_COMBINATIONS[(index + 1) % len(ALL_COMBINATIONS)]))
        [fresh] = family.conditioner.tokenize([text])
        return RolloutRequest(prompt=fresh, task=Task.T2I, requested_artifacts=(
            "image_latent", "image"), sampling=SamplingSpec(
                num_steps=args.steps, guidance_scale=4.0, seeds=tuple(range(args.samples))))

    default = load_graph_config(graph_config(args.steps))
    variants = {"default": default}
    # the scorer stage's micro-batch wait as it was (10 ms): one request alone waited it out
    old = graph_config(args.steps)
    old["scorers"][0]["batch_wait_timeout_s"] = 0.01
    variants["scorer_batch_wait_10ms"] = load_graph_config(old)
    # the encoder's and decoders' micro-batch wait at 2 ms (the default is 0)
    waiting = graph_config(args.steps)
    waiting["encoder"] = {"batch_wait_timeout_s": 0.002}
    waiting["decoder"] = {"batch_wait_timeout_s": 0.002}
    variants["encoder_decoder_batch_wait_2ms"] = load_graph_config(waiting)
    ray.init(address="local", num_cpus=8, object_store_memory=256 * 2**20,
             include_dashboard=False, log_to_driver=False, namespace="omni-bench")
    serve.start(proxy_location="Disabled")
    local = InProcess(default)
    loop = asyncio.new_event_loop()
    runs = {}
    try:
        for name, config in variants.items():
            # the same fixed cost against a training-sized request (a group of 16, 20 steps)
            larger = {"16x20": lambda: request(16, 20)} if name == "default" else None
            bursting = guided if name != "scorer_batch_wait_10ms" else None
            runs[name] = measure(config, args.iters, request, local, loop, larger, bursting)
        floor = rpc_floor()
    finally:
        serve.shutdown()
        ray.shutdown()
        loop.close()

    main_run = runs["default"]
    result = {
        "what": "tiny_t2i graph (ingress handle + materialize) vs the same stage code in-process",
        "batch": {"prompts": 1, "samples_per_prompt": args.samples, "num_steps": args.steps,
                  "height": 32, "width": 32},
        "iters": args.iters, "torch_threads": 1,
        "in_process_encoder": "the encoder stage's class with the graph's prompt-embedding "
                              "cache (the repeated prompt is a hit in both)",
        **{k: main_run[k] for k in ("deploy_s", "graph_s", "in_process_s", "graph_overhead")},
        "graph_overhead_goal": 1.15,
        "fixed_cost_per_request_ms": main_run["graph_minus_in_process_ms"],
        "in_process_stage_median_s": main_run["in_process_stage_median_s"],
        "at_training_size": main_run["larger_requests"],
        "breakdown": {k: v for k, v in main_run.items()
                      if k.endswith("_ms") and k != "graph_minus_in_process_ms"},
        "variants": {name: {"graph_overhead": r["graph_overhead"],
                            "fixed_cost_per_request_ms": r["graph_minus_in_process_ms"],
                            "score_hop_ms": r["hops_ms"]["score_s"], "burst": r["burst"]}
                     for name, r in runs.items()},
        "rpc_floor": floor, "critical_path": floor_of(floor),
        "ingress_bytes": main_run["ingress_bytes"], "ingress_bytes_goal": 0,
        "delivered_bytes_per_call": main_run["delivered_bytes_per_call"],
        "cpu_count": os.cpu_count(), "machine_note": args.note,
        "load_avg_1m_at_start": load_start, "load_avg_1m_at_end": os.getloadavg()[0],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "graph.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "graph.png")
    print(json.dumps({k: result[k] for k in ("graph_overhead", "fixed_cost_per_request_ms",
                                             "breakdown", "variants", "at_training_size",
                                             "rpc_floor", "critical_path", "ingress_bytes")},
                     indent=1))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    stages = result["in_process_stage_median_s"]
    bottom = 0.0
    for name, value in stages.items():
        ax1.bar(["in-process"], [value * 1e3], bottom=[bottom * 1e3], label=name)
        bottom += value
    ax1.bar(["graph"], [result["graph_s"]["median"] * 1e3], color="gray",
            label=f"graph end to end (x{result['graph_overhead']:.2f})")
    ax1.set_ylabel("median ms per call")
    ax1.set_title(f"1 prompt x {result['batch']['samples_per_prompt']} samples, "
                  f"{result['batch']['num_steps']} steps "
                  f"(+{result['fixed_cost_per_request_ms']:.0f} ms per request)", fontsize=9)
    ax1.legend(fontsize=7)
    b, hops = result["breakdown"], result["breakdown"]["hops_ms"]
    parts = {"caller <-> ingress": b["handle_call_outside_ingress_ms"],
             "prompt check hop": hops["ingress_check_s"],
             "encode + rollout hops\n(incl. encoder compute)": b["rollout_hop_outside_engine_ms"],
             "decode hop": b["decode_hop_outside_decoder_ms"],
             "score hop (incl. scoring)": hops["score_s"],
             "caller's fetch": b["caller_fetch_ms"]}
    ax2.barh(list(parts), list(parts.values()), color="C1")
    crit = result["critical_path"]
    floor = {f"RPC floor: {len(hops)} x {kind.replace('_', ' ')}": crit["ms_by_kind"][kind]
             for kind, hops in crit["hops"].items()}
    ax2.barh(list(floor), list(floor.values()), color="C7")
    ax2.set_xlabel("ms (median)")
    ax2.set_title(f"per-hop wall time (fixed cost {result['fixed_cost_per_request_ms']:.0f} ms; "
                  f"empty-RPC floor {crit['floor_ms']:.0f} ms)", fontsize=9)
    ax2.tick_params(axis="y", labelsize=7)
    names = list(result["variants"])
    ax3.bar(range(len(names)), [result["variants"][n]["graph_overhead"] for n in names],
            color="C0")
    ax3.set_xticks(range(len(names)), [n.replace("_", " ").replace("batch wait", "\nbatch wait")
                                       for n in names], fontsize=7)
    ax3.axhline(result["graph_overhead_goal"], color="k", ls="--", lw=1, label="goal")
    ax3.set_ylabel("graph / in-process")
    ax3.set_title(f"ingress tensor bytes: {result['ingress_bytes']} (goal 0)", fontsize=9)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
