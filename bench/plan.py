"""Capacity planner: replicas and devices per stage from measured per-stage costs.

    python -m bench.plan --config configs/cluster_t2va_64gpu.yaml --gpus 64 \\
        --costs bench/costs/av30b_h200.json [--samples-per-step 256] [--learner-gpus 8]
    python -m bench.plan --config configs/train_sd35_gpu.yaml --gpus 64 --learner-gpus auto
    python -m bench.plan --memory configs/train_sd35_gpu.yaml [--architecture all]   (bytes per
        process at real sizes from meta-device modules: bench/memory_plan.py)

Reads the graph config (which stages exist, the devices one replica of each holds: num_gpus,
or etp x num_gpus_per_shard + num_gpus for the encoder; num_cpus for a CPU cost file; a trainer
config gives its graph and its prompts x samples per step) and a cost file (default: the
estimate for the config's `rollout.architecture`, bench/costs): seconds per sample (or per
request) of ONE replica of each stage, measured with that stage alone (bench/plan_bench.py on
this machine, or a GPU run), plus the learner's seconds per trained sample per device. Then:

  stage capacity     replicas x samples/s of one replica
  throughput         min over stages (the bottleneck); with a shared device pool (CPU cores
                     here) also <= pool / (sum of the stages' device-seconds per sample + the
                     graph's own core-seconds per sample, `graph_overhead` in the cost file)
  allocation         one replica per stage, then one more to the bottleneck while devices last
  trainer step       samples_per_step / throughput (rollout), samples_per_step x learner cost /
                     learner devices (update); async = the larger, serial = the sum
Prints the table, writes plan.json + plan.png. A stage of the config without a measurement is a
ConfigError naming it: the planner never guesses a cost.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from contract import ConfigError
from contract.cli import run_cli

RESULTS = Path(__file__).resolve().parent / "results"
COSTS = Path(__file__).resolve().parent / "costs"
# the cost file of a shipped architecture (adapters/architectures), the default for a config
# that names it; other configs default to this machine's measured tiny stages
ARCHITECTURE_COSTS = {"sd3.5-medium": COSTS / "sd35_medium_h200.json"}


@dataclass
class StageCost:
    """One stage of the graph as the planner sees it."""

    key: str                  # cost-file key: encoder, rollout, decoder:<latent>, scorer:<name>
    deployment: str
    devices_per_replica: float
    seconds_per_sample: float  # one replica, wall
    threads: int = 1           # cores one replica keeps busy (a shared CPU pool's demand)
    share: float = 1.0         # a fractional-GPU replica runs at its share of the measured speed
    min_replicas: int = 1
    max_replicas: int | None = None

    @property
    def samples_per_s(self) -> float:
        return self.share / self.seconds_per_sample


@dataclass
class Plan:
    devices: float
    device: str
    replicas: dict[str, int]
    throughput: float               # samples/s
    bottleneck: str
    rows: list[dict[str, Any]]
    trainer: dict[str, float] = field(default_factory=dict)
    source: str = ""
    limited_by: str = "stages"      # or "device pool"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stage_key(deployment: str) -> str:
    if deployment == "TextEncoder":
        return "encoder"
    if deployment == "DiTRollout":
        return "rollout"
    if deployment == "RolloutGraph":
        return "ingress"
    kind, _, name = deployment.partition("_")
    return f"{kind.lower()}:{name}"


def load_costs(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("no measurements: run `python -m bench.plan_bench` (or a GPU run) "
                          "to produce the per-stage costs", field="costs", actual=str(path))
    try:
        costs = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the cost file is not JSON: {exc.msg} (line {exc.lineno})",
                          field="costs", actual=str(path)) from None
    if not isinstance(costs, dict) or not isinstance(costs.get("stages"), dict) \
            or not costs["stages"]:
        raise ConfigError("the cost file holds no per-stage measurements", field="costs.stages",
                          actual=str(path))
    return costs


def stage_costs(config, costs: Mapping[str, Any], latents: Sequence[str] | None = None,
                skip: Sequence[str] = ()) -> list[StageCost]:
    """The config's stages with their measured costs; ConfigError naming any stage the cost
    file does not cover (or covers with a non-positive time). `latents`: the decoders, when
    the checkpoint that lists them is not on this machine; `skip`: stage keys left out on
    purpose (the caller says why)."""
    from deployments.topology import stage_options
    device = costs.get("device_kind", "GPU")
    per_request = float(costs.get("samples_per_request", 1))
    out = []
    for deployment, (cfg_field, opts) in stage_options(config, latents).items():
        key = stage_key(deployment)
        if key in skip:
            continue
        measured = costs["stages"].get(key)
        if measured is None:
            raise ConfigError(f"no measurement for stage {deployment}", field=f"costs.stages.{key}",
                              expected="seconds_per_sample or seconds_per_request",
                              actual=sorted(costs["stages"]))
        if "seconds_per_sample" in measured:
            seconds = float(measured["seconds_per_sample"])
        elif "seconds_per_request" in measured:
            seconds = float(measured["seconds_per_request"]) / per_request
        else:
            raise ConfigError(f"the measurement of {deployment} has no time",
                              field=f"costs.stages.{key}", actual=measured)
        if not seconds > 0 or not math.isfinite(seconds):
            raise ConfigError(f"the measured time of {deployment} must be > 0",
                              field=f"costs.stages.{key}", actual=seconds)
        auto = opts.get("autoscaling_config") or {}
        devices = replica_devices(opts, device)
        out.append(StageCost(key, deployment, devices, seconds,
                             threads=int(measured.get("threads", 1)),
                             share=devices if device == "GPU" and 0 < devices < 1 else 1.0,
                             min_replicas=max(int(auto.get("min_replicas", 1)), 1),
                             max_replicas=auto.get("max_replicas")))
    return out


def replica_devices(options: Mapping[str, Any], device: str) -> float:
    """Devices one replica holds: its bundles (ETP: replica + shards) or its actor options."""
    key = "GPU" if device == "GPU" else "CPU"
    if options.get("placement_group_bundles"):
        return float(sum(b.get(key, 0.0) for b in options["placement_group_bundles"]))
    actor = options.get("ray_actor_options", {})
    return float(actor.get("num_gpus" if key == "GPU" else "num_cpus", 0.0))


def graph_overhead_per_sample(costs: Mapping[str, Any]) -> float:
    """Core-seconds per sample the graph itself spends beside the stages' compute (Serve hops,
    serialisation, the ingress, Ray's own processes), from the cost file's `graph_overhead`
    (measured by bench/plan_bench.py); 0 when the file has none."""
    overhead = costs.get("graph_overhead") or {}
    per_request = float(overhead.get("core_seconds_per_request", 0.0))
    return max(per_request, 0.0) / float(costs.get("samples_per_request", 1))


def predict(stages: list[StageCost], replicas: Mapping[str, int],
            pool: float | None = None, overhead_s_per_sample: float = 0.0
            ) -> tuple[float, str, str]:
    """(samples/s, bottleneck stage, "stages" | "device pool"). `pool`: devices the replicas
    share (CPU cores of one machine); None = each replica has its own (GPUs).
    `overhead_s_per_sample`: what the graph itself burns on the shared pool per sample."""
    capacity = {s.key: replicas[s.key] * s.samples_per_s for s in stages}
    bottleneck = min(capacity, key=capacity.get)
    throughput, limited = capacity[bottleneck], "stages"
    if pool is not None:
        demand = sum(s.seconds_per_sample * s.threads for s in stages) + overhead_s_per_sample
        if pool / demand < throughput:
            throughput, limited = pool / demand, "device pool"
    return throughput, bottleneck, limited


def allocate(stages: list[StageCost], devices: float) -> dict[str, int]:
    """One replica each (their minimum), then one more replica to the bottleneck stage while it
    fits in `devices` (and its max_replicas); ConfigError if the minimum does not fit."""
    replicas = {s.key: s.min_replicas for s in stages}
    used = sum(s.devices_per_replica * s.min_replicas for s in stages)
    if used > devices + 1e-9:
        raise ConfigError("one replica of every stage needs more devices than the plan has",
                          field="gpus", expected=f">= {used:g}", actual=devices)
    by_key = {s.key: s for s in stages}
    while True:
        capacity = {s.key: replicas[s.key] * s.samples_per_s for s in stages}
        s = by_key[min(capacity, key=capacity.get)]
        if s.max_replicas is not None and replicas[s.key] >= s.max_replicas:
            return replicas                   # the bottleneck cannot grow: nothing else helps
        if used + s.devices_per_replica > devices + 1e-9:
            return replicas
        replicas[s.key] += 1
        used += s.devices_per_replica


def make_plan(stages: list[StageCost], devices: float, costs: Mapping[str, Any],
              samples_per_step: int, learner_devices: float,
              replicas: Mapping[str, int] | None = None, pool: float | None = None) -> Plan:
    chosen = dict(replicas) if replicas is not None else allocate(stages, devices)
    throughput, bottleneck, limited = predict(stages, chosen, pool,
                                              graph_overhead_per_sample(costs))
    rows = []
    for s in stages:
        cap = chosen[s.key] * s.samples_per_s
        rows.append({"stage": s.deployment, "key": s.key, "replicas": chosen[s.key],
                     "devices_per_replica": s.devices_per_replica,
                     "devices": round(chosen[s.key] * s.devices_per_replica, 3),
                     "replica_samples_per_s": round(s.samples_per_s, 4),
                     "capacity_samples_per_s": round(cap, 4),
                     "utilisation": round(throughput / cap, 3)})
    trainer: dict[str, float] = {"samples_per_step": samples_per_step,
                                 "rollout_s": samples_per_step / throughput}
    learner = costs.get("learner")
    if learner and learner_devices > 0:
        trainer["learner_devices"] = learner_devices
        trainer["update_s"] = samples_per_step * float(learner["seconds_per_sample"]) \
            / learner_devices
        trainer["step_s_async"] = max(trainer["rollout_s"], trainer["update_s"])
        trainer["step_s_serial"] = trainer["rollout_s"] + trainer["update_s"]
    return Plan(devices, costs.get("device_kind", "GPU"), chosen, throughput, bottleneck, rows,
                trainer, costs.get("source", ""), limited)


def best_split(stages: list[StageCost], devices: float, costs: Mapping[str, Any],
               samples_per_step: int, step: int) -> Plan:
    """The learner / graph split (learner devices in multiples of `step`) whose async trainer
    step is shortest; ConfigError when the cost file has no learner measurement."""
    if "learner" not in costs:
        raise ConfigError("no learner measurement to split the devices by",
                          field="costs.learner", actual=sorted(costs))
    best = None
    for learner in range(step, int(devices), step):
        try:
            plan = make_plan(stages, devices - learner, costs, samples_per_step, learner)
        except ConfigError:
            continue                                 # the graph no longer fits
        if best is None or plan.trainer["step_s_async"] < best.trainer["step_s_async"]:
            best = plan
    if best is None:
        raise ConfigError("no split leaves room for the graph and the learner", field="gpus",
                          actual=devices)
    return best


def format_table(plan: Plan) -> str:
    head = (f"{'stage':<26}{'replicas':>9}{'dev/repl':>10}{'devices':>9}"
            f"{'samples/s/repl':>16}{'capacity':>10}{'util':>7}")
    lines = [head, "-" * len(head)]
    for r in plan.rows:
        mark = "  <- bottleneck" if r["key"] == plan.bottleneck else ""
        lines.append(f"{r['stage']:<26}{r['replicas']:>9}{r['devices_per_replica']:>10g}"
                     f"{r['devices']:>9g}{r['replica_samples_per_s']:>16.3f}"
                     f"{r['capacity_samples_per_s']:>10.2f}{r['utilisation']:>7.2f}{mark}")
    used = sum(r["devices"] for r in plan.rows)
    lines.append(f"devices: {used:g} of {plan.devices:g} {plan.device} for the graph"
                 + (f" + {plan.trainer['learner_devices']:g} for the learner"
                    if "learner_devices" in plan.trainer else ""))
    lines.append(f"throughput: {plan.throughput:.3f} samples/s, limited by "
                 f"{plan.bottleneck if plan.limited_by == 'stages' else 'the shared device pool'}")
    t = plan.trainer
    line = f"trainer step ({t['samples_per_step']} samples): rollout {t['rollout_s']:.1f} s"
    if "update_s" in t:
        line += (f", update {t['update_s']:.1f} s -> {t['step_s_async']:.1f} s async, "
                 f"{t['step_s_serial']:.1f} s serial")
    lines.append(line)
    if plan.source:
        lines.append(f"costs: {plan.source}")
    return "\n".join(lines)


def plot(plan: Plan, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["stage"] for r in plan.rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    caps = [r["capacity_samples_per_s"] for r in plan.rows]
    colors = ["tab:red" if r["key"] == plan.bottleneck else "tab:blue" for r in plan.rows]
    ax1.barh(names, caps, color=colors)
    ax1.axvline(plan.throughput, color="k", ls="--", label=f"{plan.throughput:.2f} samples/s")
    ax1.set_xlabel("stage capacity (samples/s)")
    ax1.legend(fontsize=8)
    ax1.set_title(title, fontsize=9)
    ax2.barh(names, [r["devices"] for r in plan.rows], color="tab:green")
    ax2.set_xlabel(f"{plan.device}s")
    ax2.set_title(f"{sum(r['devices'] for r in plan.rows):g} of {plan.devices:g} {plan.device}s",
                  fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_plan_config(path: Path):
    """(graph config, samples per step or None) of a graph config file or a trainer config file
    (one with a `graph` key: its graph, prompts_per_step x samples_per_prompt)."""
    from deployments.config import load_graph_config, read_yaml
    data = read_yaml(path, field="--config")
    if isinstance(data, dict) and "graph" in data and "applications" not in data:
        from trainer.config import load_trainer_config
        trainer = load_trainer_config(path)
        return trainer.graph_config(), trainer.prompts_per_step * trainer.samples_per_prompt
    return load_graph_config(path), None


def default_costs(config) -> Path:
    """The cost file of the config's architecture, else this machine's measured stages."""
    return ARCHITECTURE_COSTS.get(config.rollout.architecture, RESULTS / "stage_costs.json")


def parse_learner_devices(value: str, devices: float) -> float | None:
    """--learner-gpus: a number of devices in [0, devices), or None for 'auto'."""
    if value == "auto":
        return None
    try:
        learner = float(value)
    except ValueError:
        raise ConfigError("learner devices are a number or 'auto'", field="--learner-gpus",
                          expected="a number or 'auto'", actual=value) from None
    if not 0 <= learner < devices:
        raise ConfigError("the learner takes every device (or fewer than none)",
                          field="--learner-gpus", expected=f"in [0, {devices:g})",
                          actual=learner)
    return learner


def main(argv: list[str] | None = None) -> int:
    import sys
    if "--memory" in (sys.argv[1:] if argv is None else argv):   # bench/memory_plan.py
        from bench.memory_plan import main as memory_main
        return memory_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path,
                        help="a graph config, or a trainer config (its graph and batch)")
    parser.add_argument("--gpus", required=True, type=float,
                        help="devices for the graph and the learner (CPU cores for a CPU cost "
                             "file)")
    parser.add_argument("--costs", type=Path, default=None,
                        help="per-stage costs (default: the config architecture's estimate in "
                             "bench/costs, else bench/results/stage_costs.json)")
    parser.add_argument("--samples-per-step", type=int, default=None,
                        help="default: a trainer config's batch, else 64")
    parser.add_argument("--learner-gpus", default="0",
                        help="devices for the learner, or 'auto': the split (in steps of "
                             "--node-gpus) with the shortest async trainer step")
    parser.add_argument("--node-gpus", type=int, default=8)
    parser.add_argument("--decoders", nargs="+", default=None, metavar="LATENT",
                        help="decoded latent kinds (e.g. image_latent) when the config's "
                             "checkpoint is not on this machine")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for plan.json + plan.png (default: print only)")
    args = parser.parse_args(argv)
    learner = parse_learner_devices(args.learner_gpus, args.gpus)
    config, batch = load_plan_config(args.config)
    if args.samples_per_step is None:
        args.samples_per_step = batch or 64
    if args.samples_per_step < 1:
        raise ConfigError("samples per step must be positive", field="--samples-per-step",
                          expected=">= 1", actual=args.samples_per_step)
    costs = load_costs(args.costs or default_costs(config))
    from deployments.topology import declared_family
    note = "" if args.decoders is not None else declared_family(config).source.note
    stages = stage_costs(config, costs, args.decoders)
    if learner is None:
        plan = best_split(stages, args.gpus, costs, args.samples_per_step, args.node_gpus)
    else:
        plan = make_plan(stages, args.gpus - learner, costs, args.samples_per_step, learner)
    print(format_table(plan))
    if note:
        print(f"model: {note}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps(plan.to_json(), indent=2) + "\n")
        plot(plan, args.out / "plan.png", f"{args.config.name}, {args.gpus:g} {plan.device}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli("python -m bench.plan", main))
