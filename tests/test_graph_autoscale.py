"""DiTRollout autoscaling from the graph config on a real local Ray cluster: 1 -> 2 replicas under
concurrent rollout load, back to 1 when idle. Replica counts are read from `serve.status()`; the
only timing checks are "reached N within T" (generous: the CPU is shared and slow)."""
from __future__ import annotations

import threading
import time

import pytest

from contract import RolloutRequest, SamplingSpec, Task
from deployments.config import load_graph_config

pytestmark = pytest.mark.timeout(420)

APP = "graph_autoscale"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
               "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
               "look_back_period_s": 1.0, "metrics_interval_s": 0.5}


def autoscale_config() -> dict:
    return {
        "app_name": APP,
        "rollout": {"adapter": "tiny_t2i"},
        "rollout_stage": {"num_cpus": 0.5, "max_ongoing_requests": 4,
                          "autoscaling": AUTOSCALING},
        "limits": {"max_prompts": 4, "max_samples_per_prompt": 8, "max_steps": 30,
                   "max_height": 32, "max_width": 32, "max_frames": 1},
        "policy_store": "graph_autoscale_store",
    }


def rollout_replicas(state: str = "RUNNING") -> int:
    from ray import serve
    app = serve.status().applications.get(APP)
    if app is None or "DiTRollout" not in app.deployments:
        return 0
    return app.deployments["DiTRollout"].replica_states.get(state, 0)


def wait_for(predicate, timeout_s: float, poll_s: float = 0.5) -> float | None:
    """Seconds until `predicate()` held, or None if it never did within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None


@pytest.fixture(scope="module")
def autoscale_graph(ray_cluster):
    from ray import serve

    from graph import build_app, delete_graph
    handle = serve.run(build_app(autoscale_config()), name=APP, route_prefix=None)
    yield handle
    delete_graph(autoscale_config())


def test_config_maps_to_serve_autoscaling_options():
    config = load_graph_config(autoscale_config())
    opts = config.rollout_stage.deployment_options("DiTRollout")
    assert opts["autoscaling_config"] == AUTOSCALING
    assert "num_replicas" not in opts              # Serve refuses both at once


def test_rollout_stage_scales_up_under_load_and_back_down(autoscale_graph):
    from adapters.registry import get_family
    adapter = get_family("tiny_t2i")
    bundle = adapter.conditioner.tokenize(["a red circle at the top left on a black background"])[0]
    assert wait_for(lambda: rollout_replicas() == 1, 60) is not None
    assert rollout_replicas() == 1

    stop = threading.Event()
    answered: list[str] = []
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        # keeps one rollout in flight at a time until told to stop (8 workers -> 8 ongoing)
        n = 0
        while not stop.is_set():
            req = RolloutRequest(prompt=bundle, task=Task.T2I, request_id=f"w{worker}-{n}",
                                 sampling=SamplingSpec(num_steps=30, seeds=(worker, 100 + n)))
            try:
                [result] = autoscale_graph.rollout.remote(req).result(timeout_s=240)
                answered.append(result.request_id)
            except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
                errors.append(exc)
                return
            n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        up = wait_for(lambda: rollout_replicas() >= 2, timeout_s=150)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    assert up is not None, f"DiTRollout never reached 2 RUNNING replicas: {rollout_replicas()}"
    assert rollout_replicas() <= 2 and answered          # max_replicas holds; load was served
    assert len(answered) == len(set(answered))

    down = wait_for(lambda: rollout_replicas() == 1 and rollout_replicas("STOPPING") == 0,
                    timeout_s=120)
    assert down is not None, f"DiTRollout did not scale back to 1: {rollout_replicas()}"
    print(f"scale-up 1->2 in {up:.1f} s under 8 concurrent rollouts; "
          f"scale-down 2->1 in {down:.1f} s after the load stopped; {len(answered)} answered")

    # the remaining replica still serves
    [again] = autoscale_graph.rollout.remote(RolloutRequest(
        prompt=bundle, task=Task.T2I, sampling=SamplingSpec(num_steps=2, seeds=(0,)))).result()
    assert again.seeds == (0,)
