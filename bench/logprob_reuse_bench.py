"""What reusing the rollout's log-probs as FlowGRPO's old-policy log-probs saves.

    python -m bench.logprob_reuse_bench [--repeats 7] [--steps 8] [--window 4]
-> bench/results/logprob_reuse.json + bench/results/logprob_reuse.png

One FlowGRPO step (`plan_update` + `run_update`: the clipped surrogate on every trained window
step, one optimizer step) on the same batch, same process, interleaved: `old_log_probs:
rollout` (rows the learner's old policy sampled keep their stored rollout log-probs) vs
`recompute` (one extra no-grad transformer forward per trained step for the old policy, as verl
computes old log-probs). The batch: the tiny_t2i family's real rollouts from the embedded
engine, sampled by the learner's own exported LoRA version. Also counted: transformer forwards
per step and the largest difference between the two steps' gradients (the rollout's log-probs
equal the learner's within the parity tolerance, so the steps agree).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from testing.logprob_reuse import VERSION, flow_grpo_batch, grpo_step
from trainer.algorithms import OldLogProbs

RESULTS = Path(__file__).parent / "results"


def run(repeats: int, num_steps: int, window: int) -> dict:
    torch.set_num_threads(1)
    learner, cfg, batch = flow_grpo_batch(num_steps, (0, window))
    modes = (OldLogProbs.ROLLOUT, OldLogProbs.RECOMPUTE)
    for mode in modes:                                              # warm-up
        grpo_step(learner, cfg, batch, mode, VERSION)
    seconds: dict[str, list[float]] = {m.value: [] for m in modes}
    out: dict[str, dict] = {}
    for _ in range(repeats):
        for mode in modes:
            grads, metrics, forwards, s = grpo_step(learner, cfg, batch, mode, VERSION)
            seconds[mode.value].append(s)
            out[mode.value] = {"grads": grads, "forwards": forwards, "loss": metrics["loss"],
                               "reused_rows": metrics["old_logprob_reused_rows"]}
    grad_diff = max(float((a - b).abs().max()) for a, b in
                    zip(out["rollout"]["grads"], out["recompute"]["grads"]))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "what": "one FlowGRPO step (plan_update + run_update) on the same batch, same process, "
                "modes interleaved: old log-probs from the rollout vs recomputed",
        "model": "tiny_t2i (embedded DiT, LoRA), 1 torch thread, CPU",
        "batch": {"rows": batch.rows, "num_steps": num_steps, "trained_window_steps": window},
        "repeats": repeats,
        "step_s": {k: {"median": med[k], "all": v} for k, v in seconds.items()},
        "transformer_forwards_per_step": {k: v["forwards"] for k, v in out.items()},
        "reused_rows": {k: v["reused_rows"] for k, v in out.items()},
        "saving_fraction_of_recompute_step": 1 - med["rollout"] / med["recompute"],
        "grad_max_abs_diff": grad_diff,
        "loss": {k: v["loss"] for k, v in out.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_1m_at_end": os.getloadavg()[0]},
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    modes = list(data["step_s"])
    a.bar(modes, [data["step_s"][m]["median"] for m in modes], color=["tab:green", "tab:gray"])
    for i, m in enumerate(modes):
        a.scatter([i] * len(data["step_s"][m]["all"]), data["step_s"][m]["all"], color="k", s=8)
    a.set_ylabel("s per FlowGRPO step (median, points: runs)")
    a.set_title(f"saving {100 * data['saving_fraction_of_recompute_step']:.0f} % of the step")
    b.bar(modes, [data["transformer_forwards_per_step"][m] for m in modes],
          color=["tab:green", "tab:gray"])
    b.set_ylabel("transformer forwards per step")
    fig.suptitle("old-policy log-probs: rollout's vs recomputed (tiny_t2i, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "logprob_reuse.json")
    args = parser.parse_args(argv)
    data = run(args.repeats, args.steps, args.window)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in data.items() if k != "machine"}, indent=2))
    return data


if __name__ == "__main__":
    main()
