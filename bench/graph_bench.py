"""Graph overhead and ingress bytes: the tiny_t2i graph on a local Ray cluster vs the same stage
code in-process, same batch, measured side by side (alternating) in one run.

    python -m bench.graph_bench [--iters 8] [--steps 8] [--samples 4]

graph_overhead = median end-to-end time through the graph (ingress handle call + fetching the
outputs from the object store) / median time of encoder -> strategy.generate -> decode -> score
in this process with the classes the deployments use (TextEncoderServer, DiffusionStrategy,
DecoderServer._decode, the registry's scorer + RewardCombiner). Both run one torch thread, as a
replica with num_cpus < 1 does.
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
            "limits": {"max_prompts": 4, "max_samples_per_prompt": 16, "max_steps": steps,
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
        self.encoder = TextEncoderServer(config.adapter, config.weights_path, 1, "cpu")
        self.strategy = build_strategy(config.rollout, config.limits)
        self.decoder = DecoderServer(config.adapter, config.weights_path, "image_latent",
                                     config.http.max_preview_pixels)
        self.scorers = {s.name: build_scorer(s.scorer) for s in config.scorers}
        self.combiner = RewardCombiner(config.reward_config)
        self.stage_s: dict[str, list[float]] = {k: [] for k in ("encode", "rollout", "decode",
                                                                "score")}

    async def run(self, request):
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
        for key, dt in zip(self.stage_s, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.stage_s[key].append(dt)
        return image, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import ray
    from ray import serve

    from adapters.registry import get_family
    from contract import RolloutRequest, SamplingSpec, Task
    from deployments.client import materialize
    from deployments.config import load_graph_config
    from deployments.ingress import tensor_bytes
    from graph import build_app

    config = load_graph_config(graph_config(args.steps))
    family = get_family("tiny_t2i")
    bundle = family.conditioner.tokenize([PROMPT])[0]

    def request() -> RolloutRequest:
        return RolloutRequest(prompt=bundle, task=Task.T2I, requested_artifacts=(
            "image_latent", "image"), sampling=SamplingSpec(
                num_steps=args.steps, seeds=tuple(range(args.samples))))

    ray.init(address="local", num_cpus=8, object_store_memory=256 * 2**20,
             include_dashboard=False, log_to_driver=False, namespace="omni-bench")
    serve.start(proxy_location="Disabled")
    t_deploy = time.perf_counter()
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    deploy_s = time.perf_counter() - t_deploy
    local = InProcess(config)
    loop = asyncio.new_event_loop()

    graph_s, local_s, delivered, replica_run_s = [], [], [], []
    try:
        for i in range(args.iters + 2):                         # 2 warm-up rounds
            t0 = time.perf_counter()
            [result] = handle.rollout.remote(request()).result(timeout_s=300)
            out = materialize(result)
            dt_graph = time.perf_counter() - t0
            t0 = time.perf_counter()
            image, report = loop.run_until_complete(local.run(request()))
            dt_local = time.perf_counter() - t0
            assert out.artifacts["image"].data.shape == image.data.shape
            assert len(out.rewards.total) == len(report.total) == args.samples
            if i >= 2:
                graph_s.append(dt_graph)
                local_s.append(dt_local)
                delivered.append(tensor_bytes(out.artifacts) + tensor_bytes(out.trajectory))
                replica_run_s.append(out.metrics["run_time_s"])      # engine loop, in replica
        ingress = handle.stats.remote().result()
    finally:
        serve.delete(APP)
        serve.shutdown()
        ray.shutdown()
        loop.close()

    g, l = statistics.median(graph_s), statistics.median(local_s)
    stages = {k: statistics.median(v[2:]) for k, v in local.stage_s.items()}
    result = {
        "what": "tiny_t2i graph (ingress handle + materialize) vs the same stage code in-process",
        "batch": {"prompts": 1, "samples_per_prompt": args.samples, "num_steps": args.steps,
                  "height": 32, "width": 32},
        "iters": args.iters, "torch_threads": 1, "deploy_s": round(deploy_s, 2),
        "graph_s": {"median": g, "min": min(graph_s), "max": max(graph_s)},
        "in_process_s": {"median": l, "min": min(local_s), "max": max(local_s)},
        "in_process_stage_median_s": stages,
        "graph_overhead": g / l, "graph_overhead_goal": 1.15,
        "graph_minus_in_process_s": g - l,
        # where the difference goes: the sampler itself (engine run time inside the replica)
        # vs everything else (hops, object store, encoder/decoder/scorer, materialize)
        "graph_rollout_run_median_s": statistics.median(replica_run_s),
        "graph_outside_sampler_s": g - statistics.median(replica_run_s),
        "in_process_outside_sampler_s": l - stages["rollout"],
        "ingress_bytes": ingress["ingress_tensor_bytes"], "ingress_bytes_goal": 0,
        "delivered_bytes_per_call": statistics.median(delivered),
        "cpu_count": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "graph.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "graph.png")
    print(json.dumps({k: result[k] for k in ("graph_overhead", "graph_minus_in_process_s",
                                             "ingress_bytes", "delivered_bytes_per_call")}))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    stages = result["in_process_stage_median_s"]
    bottom = 0.0
    for name, value in stages.items():
        ax1.bar(["in-process"], [value * 1e3], bottom=[bottom * 1e3], label=name)
        bottom += value
    overhead = max(result["graph_s"]["median"] - bottom, 0.0)
    ax1.bar(["graph"], [result["graph_s"]["median"] * 1e3], color="gray",
            label=f"graph end to end (x{result['graph_overhead']:.2f})")
    ax1.set_ylabel("median ms per call")
    ax1.set_title(f"1 prompt x {result['batch']['samples_per_prompt']} samples, "
                  f"{result['batch']['num_steps']} steps (+{overhead * 1e3:.0f} ms)")
    ax1.legend(fontsize=7)
    ax2.bar(["through ingress", "delivered to caller"],
            [result["ingress_bytes"], result["delivered_bytes_per_call"]],
            color=["tab:red", "tab:green"])
    ax2.set_ylabel("tensor bytes per call")
    ax2.set_title(f"ingress bytes: {result['ingress_bytes']} (goal 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
