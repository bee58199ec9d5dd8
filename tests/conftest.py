"""Shared fixtures. Ray is started once per session on loopback with a small object store."""
from __future__ import annotations

import os
import shutil

import pytest

from testing.loopback import free_port

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
def tiny_t2i_weights(tmp_path_factory) -> str:
    """A complete tiny_t2i weights folder (a fresh DiT / VAE at seed 0; the real MiniLM text
    encoder), read-only for the tests that load it."""
    from adapters.tiny_t2i import TinyT2IFamily
    family = TinyT2IFamily()
    path = tmp_path_factory.mktemp("tiny_t2i_weights")
    family.save(family.build(seed=0), path)
    return str(path)


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
    # a runtime_env `pip` stage clones the whole venv (torch included) into the session's
    # runtime_resources; Ray leaves it behind, so repeated runs would fill the disk. Logs stay.
    shutil.rmtree(os.path.join(context.address_info["session_dir"], "runtime_resources"),
                  ignore_errors=True)


# ---- tiers ----------------------------------------------------------------------------------
# Default tier (`make test`): unit and in-process tests, plus the smoke graph (test_graph.py's
# tiny_t2i graph through handles and HTTP) and the object keeper on the shared cluster.
# Integration tier (`make test-all`, marker `integration`): every other test that needs the
# Ray cluster -- deployed graphs, faults, autoscaling, ETP shard workers, the trainer against a
# graph, Ray Train -- and the smoke graph's slow checks below.
DEFAULT_TIER_CLUSTER_MODULES = ("test_graph.py", "test_objects.py")
SLOW_SMOKE_GRAPH_TESTS = ("test_http_fuzz_answers_2xx_or_4xx_and_every_replica_survives",
                          "test_replica_over_its_memory_bound_is_the_only_one_replaced",
                          "test_oversized_requests_are_refused_without_growing_the_ingress")


@pytest.hookimpl(tryfirst=True)       # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        if "ray_cluster" in getattr(item, "fixturenames", ()) and (
                module not in DEFAULT_TIER_CLUSTER_MODULES or
                getattr(item, "originalname", item.name) in SLOW_SMOKE_GRAPH_TESTS):
            item.add_marker(pytest.mark.integration)
