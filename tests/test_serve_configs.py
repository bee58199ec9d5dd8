"""Every shipped Serve config file, started as a user starts it on a 2-core machine, pointed at
the tiny checkpoints (tests/checkpoints.py): it becomes ready within a bound and answers one
rollout, or -- a config whose header says it `# Needs:` more -- the build refuses it with a
ConfigError; never a wait without an end.

- configs/sd3.yaml and configs/flux.yaml (the README's "your own checkpoint" commands) run as
  `serve run <config>` subprocesses, each on its own fresh local cluster of 2 CPUs;
- every other Serve config through `graph.build_app` + Serve on one shared fresh 2-CPU local
  cluster, in a process of its own (tests/serve_configs.py): one cluster start for all.
Integration tier (`-m integration`, make test): minutes on 2 cores.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from testing.loopback import free_port
from tests.serve_configs import (CONFIGS, LOCAL_CPUS, LOCAL_MEMORY_BYTES, READY_TIMEOUT_S,
                                 ROLLOUT_TIMEOUT_S, ROOT, STARTS, STARTUP_TIMED_OUT,
                                 header_needs, rollout_body, serve_config_files, user_config)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(7200)]

SERVE_RUN = ("sd3.yaml", "flux.yaml")          # started with `serve run` in a subprocess
THREE_CPUS = "sd3_three_cpus.yaml"              # sd3.yaml as it shipped: 3 CPUs
IN_PROCESS = [p.name for p in serve_config_files() if p.name not in SERVE_RUN]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
       "RAY_DEDUP_LOGS": "0"}


def test_every_serve_config_is_covered():
    assert set(SERVE_RUN) <= {p.name for p in serve_config_files()}
    for name in SERVE_RUN:                      # the README's 2-core commands must fit
        assert header_needs(CONFIGS / name) is None, name


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory) -> Path:
    from testing.snapshots import write_clap_dir
    return write_clap_dir(tmp_path_factory.mktemp("clap_tiny"))


def write_user_config(name: str, folder: Path, tiny_checkpoint, clap_dir: Path,
                      http_port: int) -> Path:
    """The shipped file, edited as a user edits it (tests/serve_configs.user_config)."""
    path = folder / name
    path.write_text(yaml.safe_dump(user_config(CONFIGS / name, tiny_checkpoint, clap_dir,
                                               http_port), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_checkpoint, clap_dir) -> dict[str, dict]:
    """The shared 2-CPU cluster's outcome per config (tests/serve_configs.py in a subprocess)."""
    folder = tmp_path_factory.mktemp("user_configs")
    port = free_port()
    paths = [write_user_config(n, folder, tiny_checkpoint, clap_dir, port) for n in IN_PROCESS]
    # configs/sd3.yaml as it shipped before it fitted: 1 + 1 + 0.5 + 0.25 + 0.25 CPUs
    three = user_config(CONFIGS / "sd3.yaml", tiny_checkpoint, clap_dir, port)
    three["applications"][0]["args"].update(encoder={"num_cpus": 1},
                                            rollout_stage={"num_cpus": 1},
                                            decoder={"num_cpus": 0.5})
    (folder / THREE_CPUS).write_text(yaml.safe_dump(three, sort_keys=False))
    paths.append(folder / THREE_CPUS)
    bound_s = len(paths) * (READY_TIMEOUT_S + ROLLOUT_TIMEOUT_S) + 300
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tests.serve_configs", "--http-port", str(port),
                           *map(str, paths)], cwd=ROOT, env=os.environ | ENV,
                          capture_output=True, text=True, timeout=bound_s)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["config"]] = result
            print(json.dumps(result)[:2000])
    print(f"{len(paths)} configs on one 2-CPU cluster: {time.monotonic() - t0:.0f} s")
    results["_stderr"] = proc.stderr[-6000:]
    return results


@pytest.mark.parametrize("name", IN_PROCESS)
def test_shipped_config_serves_on_two_cpus_or_is_refused_at_build(name, outcomes):
    result = outcomes.get(name)
    assert result is not None, f"no outcome for {name}: {outcomes['_stderr']}"
    needs = header_needs(CONFIGS / name)
    if needs is not None:                       # refused at build, naming what does not fit
        assert result["outcome"] == "refused", result
        assert result["field"].endswith((".resources", ".node_labels")) or \
            ".resources." in result["field"], result
        return
    assert result["outcome"] == "served", result
    assert result["status_code"] == 200, result
    [sample] = result["samples"]
    assert sample["seed"] == 0 and math.isfinite(sample["reward"]), sample
    print(f"{name}: ready in {result['ready_s']:.0f} s, one rollout in "
          f"{result['rollout_s']:.1f} s")


def test_a_graph_over_two_cpus_is_refused_at_build_naming_the_figures(outcomes):
    """The GPU configs on the 2-CPU cluster: the refusal says what they need, at build."""
    refused = {n: r for n, r in outcomes.items() if n not in ("_stderr", THREE_CPUS) and
               r.get("outcome") == "refused"}
    assert refused, "no shipped config needs more than 2 CPUs?"
    for name, result in refused.items():
        assert header_needs(CONFIGS / name) is not None, (name, result)
        assert any(what in result["message"] for what in ("CPU", "GPU", "memory", "label")), \
            result


def test_the_old_three_cpu_sd3_config_is_refused_naming_demand_capacity_and_waiting(outcomes):
    """The whole-graph check on the live cluster: every stage fits alone, the graph does not."""
    result = outcomes[THREE_CPUS]
    assert result["outcome"] == "refused", result
    message = result["message"]
    assert "does not fit the cluster at its starting replica counts" in message, message
    assert "needs [CPU 3.0, GPU 0.0, memory 2.00 GiB]" in message, message
    assert "have [CPU 2.0, GPU 0.0, memory 12.00 GiB]" in message, message
    assert "waiting for resources: " in message and "1 of 1 replica(s)" in message, message
    assert result["field"].endswith(".resources"), result


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, deadline: float) -> float:
    """Seconds until GET /healthz answers 200 (the ingress is up); fails if `serve run` exits
    or the deadline passes, with the end of its output."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve run exited {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass                                # the proxy is not listening yet
        time.sleep(2.0)
    pytest.fail(f"not healthy after {READY_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C as a user would (serve shuts down, the local cluster with it), then harder."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 30)):
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # its own session: serve run and its cluster
    except ProcessLookupError:
        pass                                    # nothing of it left
    proc.wait(30)


@pytest.mark.parametrize("name", SERVE_RUN)
def test_serve_run_of_a_checkpoint_config_on_two_cores(name, tiny_checkpoint, clap_dir,
                                                       tmp_path):
    """`serve run configs/<name>` with rollout.weights_path at the tiny checkpoint, on a local
    cluster of 2 CPUs: /healthz answers, then one rollout (retried while a stage is still
    starting: 503, retryable) answers 200 with a scored sample."""
    port = free_port()
    path = write_user_config(name, tmp_path, tiny_checkpoint, clap_dir, port)
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    env = os.environ | ENV | {
        "RAY_ADDRESS": "local",                 # a fresh local cluster, never another's
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": LOCAL_CPUS, "GPU": 0,
                                              "memory": LOCAL_MEMORY_BYTES})}
    t0, proc = time.monotonic(), None
    try:
        for attempt in range(1, STARTS + 1):
            log = tmp_path / f"serve_run_{attempt}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run",
                                         str(path)], cwd=ROOT, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            started = time.monotonic() + READY_TIMEOUT_S
            while proc.poll() is None and "Submitted deploy config" not in log.read_text() \
                    and time.monotonic() < started:
                time.sleep(1.0)                 # the cluster is up once the config is submitted
            if proc.returncode is None or STARTUP_TIMED_OUT not in log.read_text():
                break
            stop(proc)                          # what its failed start left
            print(f"serve run start {attempt}: Ray's raylet missed its 30 s start-up wait")
        deadline = time.monotonic() + READY_TIMEOUT_S
        healthy_s = wait_healthy(port, proc, log, deadline)
        body = rollout_body(args["rollout"]["adapter"], args.get("scorers", []))
        while True:
            reply = httpx.post(f"http://127.0.0.1:{port}/rollout", json=body,
                               timeout=ROLLOUT_TIMEOUT_S)
            if reply.status_code != 503 or time.monotonic() > deadline + ROLLOUT_TIMEOUT_S:
                break
            assert reply.json()["error"]["type"] == "StageUnavailableError", reply.text
        answered_s = time.monotonic() - t0
        assert reply.status_code == 200, (reply.text, log.read_text()[-4000:])
        [result] = reply.json()["results"]
        [sample] = result["samples"]
        assert sample["seed"] == 0 and math.isfinite(sample["reward"])
        assert {a["name"] for a in sample["artifacts"]} >= {"image_latent", "image"}
        print(f"serve run {name}: /healthz after {healthy_s:.0f} s, first rollout answered "
              f"after {answered_s:.0f} s")
    finally:
        if proc is not None:
            stop(proc)
