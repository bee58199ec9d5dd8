"""Chaos on every stage of the graph on a two-node loopback cluster, under HTTP + handle load with
a trainer attached from its own process (testing/chaos.py), then the rollout node lost and back.

    python -m bench.chaos_bench [--handle-workers 2] [--http-workers 2] [--fault-window 10]

Writes bench/results/chaos.json (one row per scenario: what was killed, requests sent / answered
/ answered twice, typed retryable failures by kind, untyped or lost, seconds to healthy, the
trainer's steps after the fault) and chaos.png; `all_invariants_hold` is true when no row has a
problem (testing.chaos.check_row). The same scenarios run small in tests/test_cluster.py.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from testing.chaos import (SCENARIOS, AttachedTrainer, ChaosSetup, check_row,
                         cluster_graph_config, run_node_loss, run_scenario, two_node_cluster,
                         wait_for)
from testing.loopback import LOOPBACK_ENV

RESULTS = Path(__file__).resolve().parent / "results"
APP, STORE = "chaos", "chaos_store"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handle-workers", type=int, default=2)
    parser.add_argument("--http-workers", type=int, default=2)
    parser.add_argument("--fault-window", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # SIGTERM (a timeout, a CI cancel) unwinds the with-blocks: the cluster and the trainer go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    from ray import serve

    from adapters.registry import get_family
    from graph import build_app
    t0 = time.perf_counter()
    rows = []
    with two_node_cluster("omni-chaos-bench") as c, \
            tempfile.TemporaryDirectory(prefix="omni_chaos_") as tmp:
        graph_cfg = cluster_graph_config(APP, STORE)
        handle = serve.run(build_app(graph_cfg), name=APP, route_prefix=f"/{APP}")
        trainer = AttachedTrainer(Path(tmp) / "trainer", graph_cfg,
                                  dict(os.environ, **LOOPBACK_ENV), c.lb.address)
        try:
            if wait_for(lambda: trainer.steps() >= 1 or not trainer.alive(), 600, 2.0) is None \
                    or not trainer.alive():
                raise RuntimeError(f"the trainer did not start: {trainer.tail()}")
            setup = ChaosSetup(APP, STORE, handle, get_family("tiny_t2i"),
                               f"http://127.0.0.1:{c.http_port}/{APP}/rollout", trainer,
                               handle_workers=args.handle_workers,
                               http_workers=args.http_workers,
                               fault_window_s=args.fault_window)
            for scenario in SCENARIOS:
                rows.append(run_scenario(setup, scenario))
                print(json.dumps(rows[-1]), flush=True)
            trainer_summary = {"steps": trainer.steps(), "rollout_retries": trainer.retries(),
                               "alive_through_all_faults": trainer.alive()}
        finally:
            trainer.stop()
        setup.trainer = None
        rows.append(run_node_loss(setup, c.lb, c.rollout))
        print(json.dumps(rows[-1]), flush=True)
        serve.delete(APP)
    problems = {row["scenario"]: check_row(row) for row in rows}
    result = {"what": "chaos on every stage, two-node loopback cluster (tiny_t2i graph: "
                      "encoder ETP 2 + decoder + scorer + ingress on the head, rollout on the "
                      "second node, autoscaled 1..2), HTTP + handle closed-loop traffic, a "
                      "trainer attached from its own process",
              "load": {"handle_workers": args.handle_workers, "http_workers": args.http_workers,
                       "fault_window_s": args.fault_window},
              "rows": rows, "trainer": trainer_summary, "problems": problems,
              "all_invariants_hold": not any(problems.values()),
              "wall_s": round(time.perf_counter() - t0, 1), "cpu_count": os.cpu_count(),
              "load_avg_1m_at_end": os.getloadavg()[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "chaos.png")
    print(markdown_table(rows))
    print(json.dumps({"all_invariants_hold": result["all_invariants_hold"],
                      "problems": problems}))
    return 0 if result["all_invariants_hold"] else 1


def markdown_table(rows: list[dict]) -> str:
    """The chaos table of docs/CLUSTER.md."""
    out = ["| fault | requests | answered once | typed retryable failures (retried) | never "
           "answered / untyped or lost / answered twice | healthy again after | trainer steps "
           "after it |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        failures = ", ".join(f"{k} x{v}" for k, v in sorted(r["failed_retryable"].items())) \
            or "none"
        if r["scenario"] == "autoscale":
            when = f"up 1->2 in {r['scaled_up_s']} s, back to 1 in {r['scaled_down_s']} s"
        else:
            when = f"{r['recovered_s']} s"
        trainer = r.get("trainer_steps_after_fault")
        out.append(f"| {r['scenario']} | {r['requests']} | {r['answered']} | {failures} | "
                   f"{r['never_answered']} / {r['untyped_or_lost']} / {r['answered_twice']} | "
                   f"{when} | {'-' if trainer is None else trainer} |")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = [r["scenario"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.barh(names, [r["answered"] for r in rows], label="answered (once)", color="tab:green")
    ax1.barh(names, [sum(r["failed_retryable"].values()) for r in rows], left=[
        r["answered"] for r in rows], label="typed retryable failures (retried)",
        color="tab:orange")
    ax1.set_xlabel("requests / failures")
    ax1.legend(fontsize=8)
    ax1.set_title(f"lost or untyped: {sum(r['untyped_or_lost'] for r in rows)}, answered twice: "
                  f"{sum(r['answered_twice'] for r in rows)}", fontsize=9)
    ax2.barh(names, [r.get("recovered_s") or r.get("scaled_down_s") or 0 for r in rows],
             color="tab:blue")
    ax2.set_xlabel("seconds to healthy (autoscale: to back at 1 replica)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
