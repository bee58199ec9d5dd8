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
import asyncio
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from trainer.algorithms import OldLogProbs

VERSION = "t-v0"
RESULTS = Path(__file__).parent / "results"


def flow_grpo_batch(num_steps: int = 4, window: tuple[int, int] = (0, 2), prompts: int = 2,
                    group: int = 4):
    """(learner, cfg, batch): FlowGRPO rollouts of the tiny_t2i family sampled by the learner's
    own exported adapter (version VERSION) with the embedded engine."""
    from adapters.tiny_t2i import TinyT2IFamily
    from contract import RewardReport, RolloutOutput
    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from trainer.config import PromptSource, SamplerSettings, TrainerConfig
    from trainer.learner import Learner
    from trainer.prompts import captions, make_requests
    from trainer.rollout_batch import build_batch

    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(algorithm="flow_grpo", samples_per_prompt=group,
                        prompts_per_step=prompts,
                        sampler=SamplerSettings(num_steps=num_steps, window=window))
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    with torch.no_grad():   # a nonzero trained adapter: the sampled version is not the base
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    tensors, scale = learner.export()
    engine.load_lora(VERSION, tensors, scale)
    bundles = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, prompts, 0))
    requests = make_requests(adapter, bundles, cfg.sampler, group, 0, VERSION)

    async def go():
        try:
            return [await engine.generate(EngineRequest(r, learner.encode([p]), None,
                                                        ("image_latent",), {}, VERSION))
                    for r, p in zip(requests, bundles)]
        finally:
            await engine.shutdown()
    results = asyncio.run(go())
    # rewards: distance of the sample's mean to a target, a real function of the samples
    rewards = [(-(e.latents["image_latent"].data.mean(dim=(1, 2, 3)) - 0.1).abs()).tolist()
               for e in results]
    outputs = [RolloutOutput(r.request_id, dict(e.latents), e.trajectory, e.policy_version,
                             r.sampling.seeds, rewards=RewardReport({}, tuple(rw), {}))
               for r, e, rw in zip(requests, results, rewards)]
    return learner, cfg, build_batch(learner, bundles, outputs, [r.sampling for r in requests])


def grpo_step(learner, cfg, batch, mode: OldLogProbs, old_version: str):
    """(gradients, metrics, transformer forwards, seconds) of one FlowGRPO step with the old
    log-probs from `mode`; the learner's weights, gradients and optimizer state are restored."""
    from trainer.updates import plan_update, run_update

    cfg = cfg.model_copy(update={"flow_grpo": cfg.flow_grpo.model_copy(
        update={"old_log_probs": mode})})
    saved = [p.detach().clone() for p in learner.params]
    state = copy.deepcopy(learner.optimizer.state_dict())
    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in learner.models.values()]
    grads: list[torch.Tensor] = []
    step = learner.step

    def keep_grads() -> float:
        grads.extend(p.grad.detach().clone() for p in learner.params)
        return step()
    learner.step = keep_grads
    try:
        t0 = time.perf_counter()
        plan = plan_update(cfg.algorithm, batch, cfg, torch.Generator().manual_seed(0),
                           old_version)
        metrics = run_update(learner, plan, cfg)
        seconds = time.perf_counter() - t0
    finally:
        del learner.step
        for h in hooks:
            h.remove()
        learner.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, s in zip(learner.params, saved):
                p.copy_(s)
        learner.optimizer.load_state_dict(state)
    return grads, metrics, len(calls), seconds


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
