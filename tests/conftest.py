"""Shared fixtures. Ray is started once per session on loopback with a small object store."""
from __future__ import annotations

import os
import shutil

import pytest

from bench.loopback import free_port

pytest_plugins = ["tests.checkpoints"]   # tiny_checkpoint(family): real-layout tiny checkpoints

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # every Ray port on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster + Serve with its HTTP proxy on 127.0.0.1 (a free port)."""
    import ray
    from ray import serve

    metrics_port, http_port = free_port(), free_port()
    # `_memory`: the logical memory replicas are scheduled by (their memory_mib), fixed so that
    # a machine busy at session start cannot leave a graph unschedulable (serve.run would wait
    # forever); what a replica really holds is bounded by its own guard (deployments/memory.py)
    context = ray.init(address="local", num_cpus=12, object_store_memory=512 * 2**20,
                       _memory=48 * 2**30, include_dashboard=False, log_to_driver=False,
                       _metrics_export_port=metrics_port, namespace="omni-tests")
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    yield {"metrics_port": metrics_port, "http_port": http_port}
    serve.shutdown()
    ray.shutdown()
    # a runtime_env `pip` stage clones the whole venv (~7 GB with torch) into the session's
    # runtime_resources; Ray leaves it behind, so repeated runs would fill the disk. Logs stay.
    shutil.rmtree(os.path.join(context.address_info["session_dir"], "runtime_resources"),
                  ignore_errors=True)
