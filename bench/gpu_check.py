"""GPU check at real model size: SD3.5-medium's transformer (random weights) in-process on one GPU.

    python -m bench.gpu_check          # full size, cuda, bf16 -> bench/results/gpu_check.json + .png
    python -m bench.gpu_check --tiny   # the same code at a tiny size on the CPU

(`scripts/gpu_check.sh` runs it on the GPU machine after installing the carried wheels;
docs/GPU_CHECK.md.) A config-only checkpoint folder with the published SD3.5-medium configs
(bench/sd35_skeleton.py) gives `adapters.sd3.SD3Family` its spec, denoiser and sigmas; the
transformer is built from its config with random weights (speed does not depend on weights),
its output projection scaled once so the velocity has unit RMS at sigma = 1, as a trained model's
(so log-prob parity is measured at realistic magnitudes). Text conditions are random tensors of
the real shapes: the text encoders are not part of what is measured.

Per resolution (512 and 1024; `requests` requests of one row, `steps` SDE steps, CFG 4.5):
  rollout.engine_concurrent   the embedded engine, all requests in flight (step-wise batching)
  rollout.engine_sequential   the same engine, one request at a time
  rollout.static_batch        the plain denoising loop over all rows in one call (flow_grpo)
  rollout.one_at_a_time_loop  the plain loop, one request per call (a diffusers pipeline loop)
  learner                     trainer.updates.grpo_update on one GRPO group (`group` rows, one
                              trained timestep): trainer.learner.Learner in bf16 with gradient
                              checkpointing; time and peak GPU memory
  parity                      the learner's adapter published to the engine as a version, a
                              group rolled out with it, every window step's log-prob recomputed
                              through the learner: |ratio - 1| on-policy
Every measurement is recorded on its own (an error or a skip is recorded, not fatal); the JSON
is rewritten after each one, and measurements are skipped once the time budget is spent.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from bench import gpu_measures as m
from bench.gpu_measures import CheckSize
from bench.sd35_skeleton import SD35_MEDIUM_TRANSFORMER, TINY_SD35_TRANSFORMER
from rollout.config import EngineLimits
from rollout.engine import EmbeddedEngine

RESULTS = Path(__file__).resolve().parent / "results"

FULL = CheckSize("full", SD35_MEDIUM_TRANSFORMER, (512, 1024), requests=16, steps=10, group=8,
                 max_sequence_length=256, device="cuda", dtype="bfloat16", budget_s=400.0,
                 parity_tolerance=2e-3, min_left_s=20.0)
TINY = CheckSize("tiny", TINY_SD35_TRANSFORMER, (64, 128), requests=4, steps=4, group=4,
                 max_sequence_length=16, device="cpu", dtype="bfloat16", budget_s=120.0,
                 parity_tolerance=2e-3)


class Report:
    """The JSON being built: each measurement under its dotted key, written after each one."""

    def __init__(self, path: Path, budget_s: float, min_left_s: float):
        self.path, self.start = path, time.monotonic()
        self.deadline, self.min_left_s = self.start + budget_s, min_left_s
        self.data: dict[str, Any] = {"bench": "gpu_check", "budget_s": budget_s}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def put(self, key: str, value: Any) -> None:
        node = self.data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def measure(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run one measurement; its result, error or skip goes under `key`."""
        if self.left_s() < self.min_left_s:
            self.put(key, {"skipped": f"time budget spent ({self.data['budget_s']:g} s)"})
            self.write()
            return None
        t0 = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            tail = traceback.format_exc().strip().splitlines()[-6:]
            value = {"error": f"{type(exc).__name__}: {exc}"[:800], "traceback_tail": tail}
            print(f"[gpu_check] {key}: {value['error']}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            print(f"[gpu_check] {key}: done in {time.monotonic() - t0:.1f} s", flush=True)
        self.put(key, value)
        self.write()
        return None if isinstance(value, dict) and "error" in value else value

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def environment(setup_device: str) -> dict:
    import diffusers
    import peft
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "diffusers": diffusers.__version__, "peft": peft.__version__,
           "device": setup_device, "cpu_count": os.cpu_count()}
    if setup_device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_mib=props.total_memory / 2**20,
                   cuda=torch.version.cuda)
    return env


def run(size: CheckSize, out: Path, budget_s: float | None = None) -> dict:
    report = Report(out, budget_s or size.budget_s, size.min_left_s)
    report.data.update(size=size.name, dtype=size.dtype, guidance_scale=m.GUIDANCE_SCALE,
                       requests=size.requests, steps=size.steps, sampler="sde", group=size.group,
                       model="SD3Transformer2DModel, the published SD3.5-medium config"
                       if size.name == "full" else "SD3Transformer2DModel, a tiny SD3.5 layout",
                       transformer_config=size.transformer,
                       weights="random (speed does not depend on weights); proj_out scaled to "
                               "a unit-RMS velocity at sigma = 1",
                       text_conditions="random tensors of the real shapes (CLIP-L/G + T5 "
                                       "prompt_embeds, pooled); the text encoders are not "
                                       "measured")
    report.measure("environment", lambda: environment(size.device))
    holder: dict[str, m.Setup] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def setup_model() -> dict:
            t0 = time.perf_counter()
            setup = m.build(size, Path(tmp) / "sd35_medium_skeleton")
            info = m.calibrate(setup)
            limits = EngineLimits(max_batch_rows=max(size.requests, size.group))
            setup.engine = EmbeddedEngine(setup.family, {"transformer": setup.model}, {},
                                          limits, device=str(setup.device))
            holder["setup"] = setup
            return info | {"seconds": time.perf_counter() - t0}

        if report.measure("setup", setup_model) is None:
            return report.data
        setup = holder["setup"]
        try:
            measure_all(report, setup)
        finally:
            asyncio.run(setup.engine.shutdown())
    report.measure("imports", imports)
    report.measure("plot", lambda: plot(report.data, out.with_suffix(".png")))
    return report.data


def plot(data: dict, path: Path) -> dict:
    """samples/s of each rollout mode per resolution; the learner's step time and peak memory
    with the parity figure per resolution."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = [k for k in data.get("rollout", {})]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / len(m.MODES)
    for i, mode in enumerate(m.MODES):
        values = [data["rollout"][k].get(mode, {}).get("samples_per_s", 0.0) for k in sides]
        ax1.bar([j + i * width for j in range(len(sides))], values, width, label=mode)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(sides))], sides)
    ax1.set_ylabel("samples / s")
    ax1.set_title(f"{data['requests']} requests x {data['steps']} SDE steps, CFG "
                  f"{data['guidance_scale']:g}, {data['dtype']}", fontsize=9)
    ax1.legend(fontsize=8)
    learner = [data.get("learner", {}).get(k, {}) for k in sides]
    ax2.bar(sides, [entry.get("seconds", 0.0) for entry in learner], color="C4")
    for j, (k, entry) in enumerate(zip(sides, learner)):
        peak = entry.get("peak_gpu_mib")
        par = data.get("parity", {}).get(k, {}).get("max_abs_ratio_minus_1")
        label = (f"peak {peak / 1024:.1f} GiB\n" if peak else "") + \
            (f"|ratio-1| {par:.1e}" if par is not None else "")
        ax2.text(j, entry.get("seconds", 0.0), label, ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("seconds per grpo_update (1 timestep)")
    ax2.set_title(f"learner: {data['group']} rows, bf16 + gradient checkpointing", fontsize=9)
    fig.suptitle(f"GPU check ({data['size']}): {data.get('model', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"path": str(path)}


def imports() -> dict:
    """The distributions the project modules this run loaded import at module level, and those
    of them the GPU machine lacks (bench/gpu_env.py: its packages + the carried wheels)."""
    import sys

    from bench.gpu_env import missing_on_gpu, module_level_imports
    found = module_level_imports(sys.modules)
    return {"distributions": {d: sorted(mods)[:4] for d, mods in sorted(found.items())},
            "missing_on_gpu_machine": missing_on_gpu(set(found))}


def measure_all(report: Report, setup: m.Setup) -> None:
    size = setup.size
    report.measure("learner.setup", lambda: m.build_learner(setup))
    for side in size.resolutions:
        key = f"{side}x{side}"
        sampling = m.make_requests(setup, 1, side, size.steps)[0].request.sampling
        report.put(f"rollout.{key}.sigmas",
                   [round(float(s), 5) for s in setup.family.sigmas(sampling)])
        report.measure(f"rollout.{key}.warm_up", lambda: m.warm_up(setup, side))
        for mode in m.MODES:
            report.measure(f"rollout.{key}.{mode}", lambda: m.time_mode(setup, mode, side))
        report.put(f"rollout.{key}.ratios", m.ratios(report.data["rollout"][key]))
        if setup.learner is None:
            for part in ("learner", "parity"):
                report.put(f"{part}.{key}", {"skipped": "learner.setup failed"})
            continue
        report.measure(f"learner.{key}", lambda: m.learner_step(setup, side))
        report.measure(f"parity.{key}", lambda: m.parity(setup, side))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny SD3.5 layout on the CPU")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the size's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="time budget of the measurements (default: the size's)")
    args = parser.parse_args(argv)
    size = TINY if args.tiny else FULL
    if args.dtype is not None:
        size = dataclasses.replace(size, dtype=args.dtype)
    out = args.out or (RESULTS / "gpu_check.json" if size.name == "full"
                       else Path("runs") / "gpu_check_tiny.json")
    data = run(size, out, args.budget_s)
    print(f"[gpu_check] wrote {out}")
    failed = [k for k, v in _leaves(data) if k.endswith(".error")]
    return 1 if failed or "setup" not in data or "error" in data.get("setup", {}) else 0


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node


if __name__ == "__main__":
    raise SystemExit(main())
