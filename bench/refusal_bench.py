"""What refusing an oversized request costs, beside serving a valid one, over the same HTTP path.

    python -m bench.refusal_bench [--iters 10]

The tiny_t2i graph behind Serve's HTTP proxy on 127.0.0.1 with the limits below. Each body in
OVERSIZED (10^9 samples, 10^5 prompts, 10^7 steps, 10^6 px, an 800 KB prompt) and one valid
request (1 prompt x 4 samples x 8 steps, the baseline: what the same path costs doing real work)
are posted once to warm up and then `iters` times. Per case: the ingress's own time (its
Server-Timing header), the client's round trip, `parse_rollout_body` alone in this process, and
the ingress's peak RSS growth over the timed posts (from a reset peak) and what it still holds
after them (`rss_retained_mib`). `vs_valid` = a refusal's ingress time / the valid request's.
Writes bench/results/refusal.json + refusal.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

from testing.oversized import LIMITS, OVERSIZED, PROMPT

RESULTS = Path(__file__).resolve().parent / "results"
APP, PREFIX = "refusal_bench", "/refusal_bench"
VALID = {"prompts": [PROMPT], "samples_per_prompt": 4, "num_steps": 8}


def graph_config() -> dict:
    return {"app_name": APP, "rollout": {"adapter": "tiny_t2i"},
            "rollout_stage": {"num_cpus": 0.5},
            "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                         "inputs": ["image"], "reward": {"policy": "required"}}],
            "limits": LIMITS, "policy_store": "refusal_bench_store"}


def post(port: int, data: bytes) -> tuple[int, dict, float, float]:
    """(status, JSON body, the ingress's own ms from Server-Timing, the round trip in ms)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{PREFIX}/rollout", data=data,
                                 method="POST", headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    round_trip_ms = (time.perf_counter() - start) * 1e3
    ingress_ms = float(headers.get("Server-Timing", "dur=nan").split("dur=")[1])
    return status, json.loads(raw), ingress_ms, round_trip_ms


def measure_case(port: int, graph, data: bytes, iters: int, expect: int) -> dict:
    status, payload, _, _ = post(port, data)                 # warm: Serve's and malloc's growth
    if status != expect:
        raise RuntimeError(f"expected {expect}, got {status}: {payload}")
    before = graph.stats.remote(reset_peak=True).result()
    ingress, trips = [], []
    for _ in range(iters):
        status, payload, ingress_ms, trip_ms = post(port, data)
        if status != expect:
            raise RuntimeError(f"expected {expect}, got {status}: {payload}")
        ingress.append(ingress_ms)
        trips.append(trip_ms)
    after = graph.stats.remote().result()
    return {"status": status, "body_bytes": len(data),
            "ingress_ms": round(statistics.median(ingress), 3),
            "round_trip_ms": round(statistics.median(trips), 3),
            "peak_rss_growth_mib": round((after["peak_rss_bytes"] - before["rss_bytes"]) / 2**20,
                                         2),
            "rss_retained_mib": round((after["rss_bytes"] - before["rss_bytes"]) / 2**20, 2),
            "field": payload["error"]["field"] if "error" in payload else None}


def parse_ms(data: bytes, iters: int) -> float:
    """parse_rollout_body alone, in this process (the check the ingress runs first)."""
    from contract import LimitExceededError, RequestLimits
    from contract.http import parse_rollout_body
    limits, times = RequestLimits(**LIMITS), []
    for _ in range(iters):
        start = time.perf_counter()
        try:
            parse_rollout_body(data, limits)
        except LimitExceededError:
            pass
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)

    from trainer.demo import RAY_ENV
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)   # before Ray starts, so every worker inherits them
    import ray
    from ray import serve

    from testing.loopback import free_port
    from graph import build_app
    port = free_port()
    ray.init(address="local", num_cpus=8, object_store_memory=256 * 2**20,
             include_dashboard=False, log_to_driver=False, namespace="omni-bench")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cases: dict[str, dict] = {}
    try:
        graph = serve.run(build_app(graph_config()), name=APP, route_prefix=PREFIX)
        cases["valid"] = measure_case(port, graph, json.dumps(VALID).encode(), args.iters, 200)
        for body, field in OVERSIZED:
            data = json.dumps(body).encode()
            case = measure_case(port, graph, data, args.iters, 413)
            if case["field"] != field:
                raise RuntimeError(f"{field}: refused naming {case['field']}")
            cases[field] = case | {"parse_ms_in_process": parse_ms(data, args.iters)}
    finally:
        serve.shutdown()
        ray.shutdown()
    valid_ms = cases["valid"]["ingress_ms"]
    for field, case in cases.items():
        if field != "valid":
            case["vs_valid"] = round(case["ingress_ms"] / valid_ms, 4)
    result = {"what": "ingress time and memory of refusing oversized HTTP bodies vs serving one "
                      "valid request (tiny_t2i graph, Serve HTTP on 127.0.0.1)",
              "limits": LIMITS, "valid_request": VALID, "iters": args.iters, "cases": cases,
              "cpu_count": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "refusal.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "refusal.png")
    print(json.dumps(cases, indent=1))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = result["cases"]
    names = list(cases)
    colors = ["C2" if n == "valid" else "C3" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(names, [cases[n]["ingress_ms"] for n in names], color=colors)
    ax1.set_yscale("log")
    ax1.set_ylabel("ingress ms (median, Server-Timing)")
    ax1.set_title("a refusal (red, 413 naming the field) vs one valid request (green)",
                  fontsize=9)
    ax2.bar(names, [cases[n]["peak_rss_growth_mib"] for n in names], color=colors)
    ax2.set_ylabel("ingress peak RSS growth, MiB")
    ax2.set_title(f"over {result['iters']} posts each, after one warm-up", fontsize=9)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
