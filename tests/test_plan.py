"""The capacity planner (bench/plan.py): the allocation it finds is the best one an exhaustive
search finds, a shared device pool bounds throughput, trainer step times, fractional GPUs, and a
run without measurements is a ConfigError naming the stage. The prediction check against the
measured graph is bench/plan_bench.py (a benchmark: speed is never asserted in a test)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench.plan import (StageCost, allocate, best_split, graph_overhead_per_sample, load_costs,
                        main, make_plan, predict, stage_costs)
from contract import ConfigError
from deployments.config import load_graph_config

ROOT = Path(__file__).resolve().parents[1]


def stages():
    return [StageCost("encoder", "TextEncoder", 1.0, 0.04),
            StageCost("rollout", "DiTRollout", 2.0, 0.5),
            StageCost("decoder:image_latent", "Decoder_image_latent", 1.0, 0.12)]


def brute_force(stages, devices):
    """max over integer replica counts (>= 1, within devices) of the min stage capacity."""
    best = 0.0
    for counts in itertools.product(range(1, int(devices) + 1), repeat=len(stages)):
        if sum(c * s.devices_per_replica for c, s in zip(counts, stages)) <= devices:
            best = max(best, min(c * s.samples_per_s for c, s in zip(counts, stages)))
    return best


@pytest.mark.parametrize("devices", [4, 7, 12, 16])
def test_allocation_reaches_the_best_min_capacity(devices):
    s = stages()
    replicas = allocate(s, devices)
    used = sum(replicas[x.key] * x.devices_per_replica for x in s)
    assert used <= devices
    throughput, bottleneck, limited = predict(s, replicas)
    assert throughput == pytest.approx(brute_force(s, devices))
    assert limited == "stages"
    assert throughput == pytest.approx(replicas[bottleneck] * {x.key: x for x in s}[
        bottleneck].samples_per_s)


def test_minimum_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError) as e:
        allocate(stages(), 3)
    assert e.value.field == "gpus" and e.value.expected == ">= 4"


def test_shared_pool_and_trainer_step():
    s = stages()
    replicas = {"encoder": 1, "rollout": 4, "decoder:image_latent": 2}
    # per-stage bound: rollout 4 x 2/s = 8/s; the pool: 2 cores / (0.04 + 0.5 + 0.12) s = 3.03/s
    throughput, bottleneck, limited = predict(s, replicas, pool=2.0)
    assert limited == "device pool" and throughput == pytest.approx(2.0 / 0.66)
    # the graph's own CPU per request (0.4 core-s for 4 samples) shares the pool too
    overhead = graph_overhead_per_sample({"samples_per_request": 4,
                                          "graph_overhead": {"core_seconds_per_request": 0.4}})
    assert overhead == pytest.approx(0.1) and graph_overhead_per_sample({}) == 0.0
    assert predict(s, replicas, 2.0, overhead)[0] == pytest.approx(2.0 / 0.76)
    assert predict(s, replicas, None, overhead)[0] == pytest.approx(min(8.0, 1 / 0.04, 2 / 0.12))
    costs = {"device_kind": "GPU", "learner": {"seconds_per_sample": 0.3}}
    plan = make_plan(s, 12, costs, samples_per_step=48, learner_devices=4, replicas=replicas)
    assert plan.throughput == pytest.approx(min(8.0, 1 / 0.04, 2 / 0.12))
    assert plan.trainer["rollout_s"] == pytest.approx(48 / plan.throughput)
    assert plan.trainer["update_s"] == pytest.approx(48 * 0.3 / 4)
    assert plan.trainer["step_s_async"] == max(plan.trainer["rollout_s"], plan.trainer["update_s"])
    assert plan.trainer["step_s_serial"] == pytest.approx(plan.trainer["rollout_s"] +
                                                          plan.trainer["update_s"])
    split = best_split(s, 24, costs, 48, step=4)
    for learner in range(4, 24, 4):          # no other split gives a shorter async step
        try:
            other = make_plan(s, 24 - learner, costs, 48, learner)
        except ConfigError:
            continue
        assert split.trainer["step_s_async"] <= other.trainer["step_s_async"] + 1e-9


def test_costs_come_from_the_config_and_missing_ones_are_named(tmp_path):
    config = load_graph_config(ROOT / "configs" / "tiny_t2i.yaml")
    measured = {"device_kind": "CPU", "samples_per_request": 4, "stages": {
        "encoder": {"seconds_per_request": 0.02}, "rollout": {"seconds_per_sample": 0.05},
        "decoder:image_latent": {"seconds_per_sample": 0.004}, "ingress": {
            "seconds_per_request": 0.01}}}
    with pytest.raises(ConfigError) as e:            # the config has a scorer nobody measured
        stage_costs(config, measured)
    assert e.value.field == "costs.stages.scorer:image_attributes"
    assert "Scorer_image_attributes" in e.value.message
    measured["stages"]["scorer:image_attributes"] = {"seconds_per_sample": 0.0}
    with pytest.raises(ConfigError) as e:
        stage_costs(config, measured)
    assert e.value.field == "costs.stages.scorer:image_attributes"
    measured["stages"]["scorer:image_attributes"] = {"seconds_per_sample": 0.001}
    by_key = {s.key: s for s in stage_costs(config, measured)}
    assert by_key["encoder"].seconds_per_sample == pytest.approx(0.02 / 4)   # per request
    assert by_key["rollout"].devices_per_replica == 1.0                      # its num_cpus
    with pytest.raises(ConfigError) as e:
        load_costs(tmp_path / "absent.json")
    assert e.value.field == "costs"
    (tmp_path / "empty.json").write_text(json.dumps({"stages": {}}))
    with pytest.raises(ConfigError) as e:
        load_costs(tmp_path / "empty.json")
    assert e.value.field == "costs.stages"


def test_gpu_plan_cli_for_the_64_gpu_cluster(tmp_path, capsys):
    assert main(["--config", str(ROOT / "configs/cluster_t2va_64gpu.yaml"), "--gpus", "64",
                 "--costs", str(ROOT / "bench/costs/av30b_h200.json"), "--learner-gpus", "16",
                 "--samples-per-step", "64", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert plan["bottleneck"] == "rollout" and "<- bottleneck" in table
    used = sum(r["devices"] for r in plan["rows"])
    assert used <= 48 and plan["trainer"]["learner_devices"] == 16
    rows = {r["key"]: r for r in plan["rows"]}
    assert rows["encoder"]["devices_per_replica"] == 4          # one ETP-4 group
    assert rows["rollout"]["devices_per_replica"] == 4          # one TP-4 replica
    # a quarter-GPU scorer runs at a quarter of its measured whole-GPU speed
    costs = load_costs(ROOT / "bench/costs/av30b_h200.json")
    clap = costs["stages"]["scorer:clap"]["seconds_per_sample"]
    assert rows["scorer:clap"]["replica_samples_per_s"] == pytest.approx(0.25 / clap, rel=1e-3)


def test_sd35_64_gpu_plan_is_rollout_bound_once_ocr_may_scale():
    costs = load_costs(ROOT / "bench/costs/sd35_medium_h200.json")
    shipped = stage_costs(load_graph_config(ROOT / "configs/gpu_sd35_pickscore_ocr.yaml"), costs,
                          latents=["image_latent"])
    assert make_plan(shipped, 56, costs, 256, 8).bottleneck == "scorer:ocr"   # 8 CPU replicas
    cluster = stage_costs(load_graph_config(ROOT / "configs/cluster_sd35_64gpu.yaml"), costs,
                          latents=["image_latent"])
    plan = best_split(cluster, 64, costs, 256, step=8)
    assert plan.bottleneck == "rollout" and plan.replicas["scorer:ocr"] <= 200
    assert plan.trainer["learner_devices"] + sum(r["devices"] for r in plan.rows) <= 64
