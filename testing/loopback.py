"""A multi-node Ray cluster on this machine's loopback: `ray start --head` plus one
`ray start --address` per extra node, each with its own logical CPUs, custom resources and node
labels -- what a user's cluster looks like to the graph, on one machine.

    with LoopbackCluster() as cluster:
        cluster.start_head(num_cpus=4, resources={"stage_node": 8}, labels={"omni.role": "stages"})
        rollout = cluster.add_node("rollout", num_cpus=2, resources={"rollout_node": 8},
                                   labels={"omni.role": "rollout"})
        ray.init(address=cluster.address)       # a driver; a trainer attaches the same way
        ...
        cluster.kill_raylet(rollout)            # the node is lost (its workers with it)
        cluster.restart(rollout)                # and comes back

Every Ray port binds 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in every process). With that
setting the `ray start` CLI refuses to join a second node ("not supported on Windows and OSX");
`_RAY_START` lifts that one CLI guard and nothing else, so the joining node binds loopback too.
Each cluster has its own temp dir and ports; `shutdown` kills exactly the processes its nodes
started (found by that temp dir and as their descendants), never another cluster's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_DEDUP_LOGS": "0",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_health_check_period_ms": "1000",   # a lost node is noticed in ~5 s (5 failed checks)
}
# `ray start` with its multi-node guard lifted for this process only (the module it reads is
# swapped for a copy with ENABLE_RAY_CLUSTER set); every Ray process still binds loopback.
_RAY_START = (
    "import sys, types\n"
    "import ray._private.ray_constants as rc\n"
    "from ray.scripts import scripts\n"
    "ns = types.SimpleNamespace(**{k: getattr(rc, k) for k in dir(rc) if not k.startswith('__')})\n"
    "ns.ENABLE_RAY_CLUSTER = True\n"
    "scripts.ray_constants = ns\n"
    "sys.argv = ['ray'] + sys.argv[1:]\n"
    "scripts.main()\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LoopbackNode:
    name: str
    num_cpus: float
    resources: dict[str, float]
    labels: dict[str, str]
    head: bool = False
    node_manager_port: int = 0
    log_monitors: set[int] = field(default_factory=set)    # started by `ray start` for it


class LoopbackCluster:
    def __init__(self, object_store_mib: int = 192, temp_root: str = "/tmp"):
        # a short path: Ray's unix sockets live under it (108-byte limit)
        self.temp_dir = tempfile.mkdtemp(prefix="omni_lb_", dir=temp_root)
        self.object_store_bytes = object_store_mib * 2**20
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.nodes: dict[str, LoopbackNode] = {}
        self.env = dict(os.environ, **LOOPBACK_ENV)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env.pop("RAY_ADDRESS", None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    # ---- nodes --------------------------------------------------------------------------
    def start_head(self, num_cpus: float, resources: dict[str, float] | None = None,
                   labels: dict[str, str] | None = None) -> LoopbackNode:
        node = LoopbackNode("head", num_cpus, dict(resources or {}), dict(labels or {}),
                            head=True)
        self.nodes[node.name] = node
        self._start(node)
        return node

    def add_node(self, name: str, num_cpus: float, resources: dict[str, float] | None = None,
                 labels: dict[str, str] | None = None) -> LoopbackNode:
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists")
        node = LoopbackNode(name, num_cpus, dict(resources or {}), dict(labels or {}))
        self.nodes[name] = node
        self._start(node)
        return node

    def _start(self, node: LoopbackNode) -> None:
        node.node_manager_port = free_port()
        args = ["--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                f"--num-cpus={node.num_cpus}", "--num-gpus=0",
                f"--resources={json.dumps(node.resources)}",
                f"--object-store-memory={self.object_store_bytes}",
                f"--node-manager-port={node.node_manager_port}",
                f"--object-manager-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}", "--disable-usage-stats"]
        if node.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in node.labels.items()))
        if node.head:
            args += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                     f"--dashboard-port={self.dashboard_port}",
                     f"--ray-client-server-port={free_port()}"]
        else:
            args += [f"--address={self.address}"]
        for attempt in range(3):
            before = self._log_monitors()
            proc = subprocess.run([sys.executable, "-c", _RAY_START, "start", *args],
                                  env=self.env, capture_output=True, text=True, timeout=300)
            node.log_monitors = self._log_monitors() - before
            if proc.returncode == 0:
                break
            # `ray start` gives a raylet 30 s to register; a loaded machine can take longer.
            # The raylet may still register: wait for it, else clear it and start again.
            if _wait(lambda: node.node_manager_port in self._alive_node_ports(), 120):
                return
            if node.head:                        # nothing of a half-started head is kept
                for pid in self._cluster_pids() - {os.getpid()}:
                    _kill(pid)
                time.sleep(2.0)
            else:
                self._kill_start(node)
            node.node_manager_port = free_port()
            args = [a for a in args if not a.startswith("--node-manager-port=")] + [
                f"--node-manager-port={node.node_manager_port}"]
        if proc.returncode != 0:
            raise RuntimeError(f"ray start ({node.name}) failed: {proc.stderr[-2000:]}")

    def _alive_node_ports(self) -> set[int]:
        """Node-manager ports of the nodes the GCS counts alive (no driver needed)."""
        from ray._private import services, state
        gcs = state.GlobalState()
        gcs._initialize_global_state(services._get_gcs_client_options(self.address))
        try:
            return {n["NodeManagerPort"] for n in gcs.node_table() if n["Alive"]}
        finally:
            gcs.disconnect()

    def _kill_start(self, node: LoopbackNode) -> None:
        """What a failed `ray start` of `node` left running."""
        try:
            raylet = self._raylet_pid(node)
            doomed = {raylet} | _descendants(raylet)
        except LookupError:
            doomed = set()
        for pid in doomed | node.log_monitors:
            _kill(pid)

    def node_id(self, node: LoopbackNode) -> str:
        """The Ray node id of `node` (matched by its node-manager port)."""
        import ray
        for n in ray.nodes():
            if n.get("Alive") and n.get("NodeManagerPort") == node.node_manager_port:
                return n["NodeID"]
        raise LookupError(f"node {node.name} is not alive")

    def kill_raylet(self, node: LoopbackNode) -> int:
        """SIGKILL the node's raylet and everything it started (its workers): the node is lost
        as a crashed machine would be. Returns the raylet's pid."""
        raylet = self._raylet_pid(node)
        for pid in {raylet} | _descendants(raylet):
            _kill(pid)
        return raylet

    def restart(self, node: LoopbackNode) -> None:
        """The lost node joins again with the same resources and labels (a new raylet); the old
        node's log monitor (which `ray start` started beside its raylet) goes first."""
        for pid in node.log_monitors:
            _kill(pid)
        self._start(node)

    def _raylet_pid(self, node: LoopbackNode) -> int:
        for pid, cmd in _processes():
            if ("raylet/raylet" in cmd and self.temp_dir in cmd
                    and f"--node_manager_port={node.node_manager_port}" in cmd):
                return pid
        raise LookupError(f"no raylet for node {node.name}")

    def _log_monitors(self) -> set[int]:
        return {pid for pid in self._cluster_pids() if "log_monitor" in _cmdline(pid)}

    def _cluster_pids(self) -> set[int]:
        """Processes of this cluster: those naming its temp dir or its GCS address, and all
        their descendants (workers, agents)."""
        address = re.compile(re.escape(self.address) + r"(?!\d)")
        roots = {pid for pid, cmd in _processes() if self.temp_dir in cmd or address.search(cmd)}
        return roots.union(*(_descendants(p) for p in roots))

    # ---- teardown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every process of this cluster (SIGTERM, then SIGKILL), remove its temp dir."""
        for attempt in range(3):
            pids = self._cluster_pids() - {os.getpid()}
            if not pids:
                break
            for pid in pids:
                _kill(pid, signal.SIGTERM if attempt == 0 else signal.SIGKILL)
            time.sleep(1.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _wait(predicate, timeout_s: float, poll_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:  # noqa: BLE001 -- the GCS is busy: ask again
            pass
        time.sleep(poll_s)
    return False


def _alive_pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _processes() -> list[tuple[int, str]]:
    return [(pid, _cmdline(pid)) for pid in _alive_pids()]


def _parents() -> dict[int, int]:
    out = {}
    for pid in _alive_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        out[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _descendants(root: int) -> set[int]:
    parents = _parents()
    out, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return out


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
