"""Chaos on every stage of a deployed graph, under sustained handle + HTTP traffic, with a trainer
attached from its own process.

Scenarios, one at a time (`run_scenario`): kill an ETP shard worker, a decoder replica, a scorer
replica, the ingress replica, the policy-store actor; and `autoscale`: more load until the rollout
stage scales up, then none until it scales back down. For each the ledger records every request
id the traffic sent and what came back:

    answered        exactly once per id (an id answered twice is a defect)
    retryable       typed errors (ReplicaFailedError / StageUnavailableError / QueueFullError, or
                    the Serve proxy's 500 when the ingress replica itself died under an HTTP
                    request -- the one answer the graph cannot type), retried with the same id
    untyped / lost  anything else, or no answer at all: a defect
and, after the fault: seconds until every deployment is HEALTHY again with a request answered,
and the attached trainer's steps completed after the kill (it retries lost rollouts and
republishes its versions to a restarted store: trainer/loop.py, trainer/sync.py).

Used by the cluster tests (tests/test_cluster.py, small load) and bench/chaos_bench.py; the
traffic and its ledger are testing/chaos_traffic.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from testing.chaos_traffic import PROMPTS, Ledger, Traffic

SCENARIOS = ("etp_shard_worker", "decoder_replica", "scorer_replica", "ingress_replica",
             "policy_store_actor", "autoscale")
STAGES_LABEL = {"omni.role": "stages"}
ROLLOUT_LABEL = {"omni.role": "rollout"}


def cluster_graph_config(app: str, store: str, stage_wait_s: float = 8.0,
                         max_rollout_replicas: int = 2) -> dict:
    """The tiny_t2i graph split over two nodes: the rollout stage on the node offering
    `rollout_node` (labelled omni.role=rollout); encoder (ETP 2, STRICT_PACK), decoder, scorer
    and ingress on the node labelled omni.role=stages."""
    on_stages = {"node_labels": STAGES_LABEL}
    return {
        "app_name": app,
        "rollout": {"adapter": "tiny_t2i", "limits": {"max_batch_rows": 16}},
        "encoder": {"etp": 2, "num_cpus": 0.1, "num_cpus_per_shard": 0.1,
                    "resources": {"stage_node": 0.01}, **on_stages},
        "rollout_stage": {"num_cpus": 0.5, "max_ongoing_requests": 8,
                          "resources": {"rollout_node": 0.01}, "node_labels": ROLLOUT_LABEL,
                          "autoscaling": {"min_replicas": 1, "max_replicas": max_rollout_replicas,
                                          "initial_replicas": 1, "target_ongoing_requests": 3,
                                          "upscale_delay_s": 1.0, "downscale_delay_s": 4.0,
                                          "look_back_period_s": 2.0,
                                          "metrics_interval_s": 0.5}},
        "decoder": {"num_cpus": 0.1, **on_stages},
        "ingress": {"num_cpus": 0.1, "max_ongoing_requests": 64, **on_stages},
        "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                     "inputs": ["image"], "reward": {"policy": "required", "timeout_s": 120},
                     "stage": {"num_cpus": 0.1, **on_stages}}],
        "limits": {"max_prompts": 4, "max_samples_per_prompt": 8, "max_steps": 20,
                   "max_height": 32, "max_width": 32, "max_frames": 1},
        "policy_store": store,
        "stage_wait_s": stage_wait_s,
    }


@contextmanager
def two_node_cluster(namespace: str = "omni-chaos") -> Iterator[SimpleNamespace]:
    """head (4 CPUs, {stage_node: 8}, omni.role=stages) + rollout (2 CPUs, {rollout_node: 8},
    omni.role=rollout) on loopback; this process is the driver; Serve's proxy on the head."""
    import ray
    from ray import serve

    from testing.loopback import LoopbackCluster, free_port
    with LoopbackCluster() as lb:
        lb.start_head(num_cpus=4, resources={"stage_node": 8}, labels=STAGES_LABEL)
        rollout = lb.add_node("rollout", num_cpus=2, resources={"rollout_node": 8},
                              labels=ROLLOUT_LABEL)
        ray.init(address=lb.address, namespace=namespace, log_to_driver=False)
        http_port = free_port()
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": http_port})
        try:
            yield SimpleNamespace(lb=lb, rollout=rollout, http_port=http_port)
        finally:
            serve.shutdown()
            ray.shutdown()


# ---- faults ----------------------------------------------------------------------------------
def replica_names(app: str, deployment: str) -> list[tuple[str, str]]:
    import ray
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]


def kill_replica(app: str, deployment: str) -> str:
    import ray
    name, namespace = replica_names(app, deployment)[0]
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return name


def kill_shard_worker(app: str) -> str:
    from ray import serve
    encoder = serve.get_deployment_handle("TextEncoder", app_name=app)
    workers = encoder.shard_workers.remote().result(timeout_s=120)
    os.kill(workers[-1]["pid"], signal.SIGKILL)          # a rank's process, not the replica
    return f"ShardWorker rank {workers[-1]['rank']} pid {workers[-1]['pid']}"


def kill_policy_store(store: str) -> str:
    import ray

    from deployments.policy_store import get_policy_store
    ray.kill(get_policy_store(store, create=False), no_restart=False)    # Ray restarts it
    return f"PolicyStore {store}"


def deployment_states(app: str) -> dict[str, tuple[str, dict]]:
    from ray import serve
    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: (d.status.value if hasattr(d.status, "value") else str(d.status),
                   dict(d.replica_states)) for name, d in status.deployments.items()}


SERVING = ("HEALTHY", "UPSCALING", "DOWNSCALING")    # autoscaling is not a fault


def healthy(app: str) -> bool:
    """Every deployment of `app` serving: a healthy (or autoscaling) status, a running replica."""
    states = deployment_states(app)
    return bool(states) and all(status in SERVING and counts.get("RUNNING", 0) >= 1
                                for status, counts in states.values())


def wait_for(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None


# ---- the attached trainer --------------------------------------------------------------------
class AttachedTrainer:
    """`python -m trainer --config <yaml>` in its own process, attached to the cluster by
    RAY_ADDRESS: the user's trainer, not a stand-in. Its progress is the number of optimizer
    steps in its metrics.jsonl."""

    def __init__(self, run_dir: Path, graph: dict, env: dict[str, str], address: str,
                 steps: int = 10_000):
        import yaml
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        config = {"graph": graph, "algorithm": "nft", "prompts": "shapes", "steps": steps,
                  "prompts_per_step": 2, "samples_per_prompt": 2,
                  "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7,
                              "window": [0, 2]},
                  "lora": {"rank": 4, "alpha": 8}, "nft": {"train_timesteps": 1},
                  "pipeline": {"mode": "async", "max_staleness": 1},
                  "eval": {"every": 100_000, "num_prompts": 2, "samples_per_prompt": 1,
                           "num_steps": 3},
                  "checks": {"time_convention": False, "lora_map": False},
                  "run_dir": str(run_dir / "run"), "checkpoint_every": 100_000,
                  "gallery": False}
        self.config_path = run_dir / "trainer.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = run_dir / "trainer.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "--config", str(self.config_path)],
            env=dict(env, RAY_ADDRESS=address), stdout=self._log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1])

    def steps(self) -> int:
        path = self.run_dir / "run" / "metrics.jsonl"
        if not path.is_file():
            return 0
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return sum(1 for r in rows if "train_s" in r)

    def retries(self) -> int:
        path = self.run_dir / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.is_file() else []
        return int(max((r.get("rollout_retries", 0) for r in rows), default=0))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def stop(self) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode


# ---- one scenario ----------------------------------------------------------------------------
@dataclass
class ChaosSetup:
    app: str
    store: str
    handle: Any
    family: Any
    http_url: str | None
    trainer: AttachedTrainer | None = None
    handle_workers: int = 1
    http_workers: int = 1
    fault_window_s: float = 8.0        # traffic keeps running this long after the fault
    recover_timeout_s: float = 240.0


def run_scenario(setup: ChaosSetup, scenario: str) -> dict[str, Any]:
    """One fault under load; the row of the chaos table."""
    if scenario == "autoscale":
        return _autoscale(setup)
    ledger = Ledger()
    traffic = Traffic(ledger, setup.handle, setup.family, setup.http_url, tag=scenario,
                      handle_workers=setup.handle_workers,
                      http_workers=setup.http_workers).start()
    trainer_before = setup.trainer.steps() if setup.trainer else 0
    time.sleep(3.0)                                    # requests in flight everywhere
    t_kill = time.monotonic()
    killed = {"etp_shard_worker": lambda: kill_shard_worker(setup.app),
              "decoder_replica": lambda: kill_replica(setup.app, "Decoder_image_latent"),
              "scorer_replica": lambda: kill_replica(setup.app, "Scorer_image_attributes"),
              "ingress_replica": lambda: kill_replica(setup.app, "RolloutGraph"),
              "policy_store_actor": lambda: kill_policy_store(setup.store)}[scenario]()
    time.sleep(setup.fault_window_s)
    recovered = wait_for(lambda: healthy(setup.app) and probe(setup), setup.recover_timeout_s,
                         poll_s=1.0)
    recovered_s = None if recovered is None else time.monotonic() - t_kill
    traffic.stop()
    trainer_after_kill = None
    if setup.trainer is not None:       # the trainer's step in flight at the kill completes
        wait_for(lambda: setup.trainer.steps() > trainer_before or not setup.trainer.alive(),
                 setup.recover_timeout_s)
        trainer_after_kill = setup.trainer.steps() - trainer_before
    summary = ledger.summary()
    return {"scenario": scenario, "killed": killed,
            "recovered_s": None if recovered_s is None else round(recovered_s, 1),
            "healthy_after": healthy(setup.app), **summary,
            "trainer_alive": None if setup.trainer is None else setup.trainer.alive(),
            "trainer_steps_after_fault": trainer_after_kill,
            "window_s": round(time.monotonic() - t_kill, 1)}


def probe(setup: ChaosSetup) -> bool:
    """One small request through the graph answers (not counted in any ledger)."""
    from contract import RolloutError, RolloutRequest, SamplingSpec, Task
    from deployments.client import RolloutClient
    bundle = setup.family.conditioner.tokenize([PROMPTS[0]])[0]
    request = RolloutRequest(prompt=bundle, task=Task.T2I,
                             sampling=SamplingSpec(num_steps=2, seeds=(0,)))
    try:
        RolloutClient(setup.handle).collect(setup.handle.rollout.remote([request]))
    except RolloutError:
        return False
    return True


def _autoscale(setup: ChaosSetup) -> dict[str, Any]:
    """Sustained load until DiTRollout has 2 replicas, then none until it is back to 1: every
    request answered, none failed."""
    ledger = Ledger()
    traffic = Traffic(ledger, setup.handle, setup.family, setup.http_url, tag="autoscale",
                      handle_workers=max(6, setup.handle_workers * 4),
                      http_workers=setup.http_workers, steps=8).start()

    def rollout_running() -> int:
        return deployment_states(setup.app).get("DiTRollout", ("", {}))[1].get("RUNNING", 0)
    try:
        up = wait_for(lambda: rollout_running() >= 2, setup.recover_timeout_s)
    finally:
        traffic.stop()
    down = wait_for(lambda: rollout_running() == 1 and healthy(setup.app),
                    setup.recover_timeout_s)
    summary = ledger.summary()
    return {"scenario": "autoscale", "killed": None,
            "scaled_up_s": None if up is None else round(up, 1),
            "scaled_down_s": None if down is None else round(down, 1),
            "healthy_after": healthy(setup.app), **summary,
            "trainer_alive": None if setup.trainer is None else setup.trainer.alive()}


def run_node_loss(setup: ChaosSetup, cluster, node) -> dict[str, Any]:
    """Kill `node`'s raylet under load (its replicas die with it; no other node offers their
    resources, so the stage is unavailable -- typed -- until the node joins again), then bring
    the node back: every request answered once, after retries."""
    import ray
    ledger = Ledger()
    traffic = Traffic(ledger, setup.handle, setup.family, setup.http_url, tag="nodeloss",
                      handle_workers=max(2, setup.handle_workers),
                      http_workers=setup.http_workers).start()
    time.sleep(3.0)
    t_kill = time.monotonic()
    cluster.kill_raylet(node)
    lost = wait_for(lambda: not any(n["Alive"] and n["NodeManagerPort"] == node.node_manager_port
                                    for n in ray.nodes()), 120)
    unavailable = wait_for(lambda: any(k.startswith("StageUnavailableError[rollout]")
                                       for k in ledger.retryable), 120)
    t_back = time.monotonic()
    cluster.restart(node)
    back = wait_for(lambda: healthy(setup.app) and probe(setup), setup.recover_timeout_s,
                    poll_s=1.0)
    traffic.stop()
    return {"scenario": "rollout_node_lost", "killed": f"raylet of node {node.name}",
            "node_marked_dead_s": None if lost is None else round(lost, 1),
            "typed_unavailable_seen": unavailable is not None,
            "recovered_s": None if back is None else round(time.monotonic() - t_back, 1),
            "outage_s": round(t_back - t_kill, 1), "healthy_after": healthy(setup.app),
            **ledger.summary(), "trainer_alive": None}


def check_row(row: dict[str, Any]) -> list[str]:
    """The invariants of one row: what a test asserts and the bench reports."""
    problems = []
    if row["untyped_or_lost"] or row["never_answered"]:
        problems.append(f"untyped/lost {row['untyped_or_lost']}, never answered "
                        f"{row['never_answered']}: {row['defects']}")
    if row["answered_twice"]:
        problems.append(f"{row['answered_twice']} ids answered twice")
    if not row["healthy_after"]:
        problems.append("graph not healthy after the fault")
    if row["requests"] == 0 or row["answered"] != row["requests"]:
        problems.append(f"answered {row['answered']} of {row['requests']}")
    if row["scenario"] == "autoscale":
        if row["scaled_up_s"] is None or row["scaled_down_s"] is None:
            problems.append("rollout stage did not scale up and back down")
        if row["failed_retryable"]:
            problems.append(f"errors under autoscaling: {row['failed_retryable']}")
    elif row["scenario"] == "rollout_node_lost":
        if not row["typed_unavailable_seen"] or row["node_marked_dead_s"] is None:
            problems.append("the lost node's stage never failed as StageUnavailableError")
        if not row["failed_then_answered"]:
            problems.append("no request failed and was answered on retry")
    elif row.get("trainer_alive") is False or row.get("trainer_steps_after_fault") == 0:
        problems.append("the attached trainer did not get past the fault")
    return problems
