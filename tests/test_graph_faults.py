"""Faults through the graph on a real local Ray cluster.

* A DiTRollout replica is killed (ray.kill of its actor) while rollouts are in flight: every
  request id is answered exactly once, or fails with ReplicaFailedError (retryable) naming it (or
  StageUnavailableError, when the replacement takes longer than the graph's stage_wait_s) and
  is answered exactly once on retry -- none lost, none twice.
* The ingress replica dies after answering (the outputs survive it, the release lands on its
  replacement), or with the caller's release in flight (the client resends it).
* An optional scorer that raises: the reward is computed from the other scorers and the failed
  one is MISSING with its reason (the required case is in tests/test_graph.py).
"""
from __future__ import annotations

import collections
import concurrent.futures
import time

import pytest

from contract import (ReplicaFailedError, RolloutRequest, SamplingSpec, ScoreStatus,
                      StageUnavailableError, Task)
from tests.serve_utils import replica_actors, wait_until_ongoing

pytestmark = pytest.mark.timeout(600)

APP = "graph_faults"


@pytest.fixture(scope="module")
def faults_graph(ray_cluster, tmp_path_factory):
    from ray import serve

    from graph import build_app, delete_graph
    from testing.snapshots import write_clip_dir
    clip_model = write_clip_dir(tmp_path_factory.mktemp("clip_tiny"))
    config = {
        "app_name": APP,
        # one request per engine batch, so requests queue in the replica (the kill lands mid-flight)
        "rollout": {"adapter": "tiny_t2i", "limits": {"max_batch_rows": 8}},
        "rollout_stage": {"num_cpus": 0.5},
        "scorers": [
            {"name": "clip", "scorer": {"kind": "clip", "params": {"model": clip_model}},
             "inputs": ["image"], "reward": {"policy": "required", "weight": 1.0}},
            {"name": "image_attributes", "scorer": {"kind": "image_attributes"},
             "inputs": ["image"], "reward": {"policy": "optional", "weight": 1.0}},
        ],
        "limits": {"max_prompts": 4, "max_samples_per_prompt": 8, "max_steps": 30,
                   "max_height": 32, "max_width": 32, "max_frames": 1},
        "policy_store": "graph_faults_store",
    }
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    yield handle
    delete_graph(config)


@pytest.fixture(scope="module")
def adapter():
    from adapters.registry import get_family
    return get_family("tiny_t2i")


def request(adapter, text: str, request_id: str | None = None, steps: int = 4,
            seeds=(0, 1)) -> RolloutRequest:
    extra = {"request_id": request_id} if request_id else {}
    return RolloutRequest(prompt=adapter.conditioner.tokenize([text])[0], task=Task.T2I,
                          sampling=SamplingSpec(num_steps=steps, seeds=seeds), **extra)


def test_optional_scorer_failure_is_missing_and_reward_comes_from_the_others(faults_graph,
                                                                             adapter):
    from deployments.client import RolloutClient
    client = RolloutClient(faults_graph)
    good, bad = client.rollout([
        request(adapter, "a red circle at the top left on a black background"),
        request(adapter, "an unparseable caption")])
    # both scorers present: the total is their weighted mean (weights 1 and 1, no normalisation)
    clip, attrs = good.rewards.by_scorer["clip"], good.rewards.by_scorer["image_attributes"]
    assert clip.status == attrs.status == (ScoreStatus.OK, ScoreStatus.OK)
    for i, total in enumerate(good.rewards.total):
        expected = (clip.scores["clip_score"][i] + attrs.scores["total"][i]) / 2
        assert total == pytest.approx(expected)
    # the optional scorer raised for this prompt: MISSING with its reason, total from clip alone
    failed = bad.rewards.by_scorer["image_attributes"]
    assert failed.status == (ScoreStatus.MISSING, ScoreStatus.MISSING)
    # an optional scorer is not asked to check prompts first: it scores, fails, is MISSING
    assert all(r and "UnscorableInputError" in r for r in failed.reasons), failed.reasons
    assert failed.scores == {}
    clip_bad = bad.rewards.by_scorer["clip"]
    assert clip_bad.status == (ScoreStatus.OK, ScoreStatus.OK)
    assert bad.rewards.total == pytest.approx(clip_bad.scores["clip_score"])


def _rollout_replica_actors() -> list[tuple[str, str]]:
    return replica_actors(APP, "DiTRollout")


def _running_rollout_replicas() -> int:
    from ray import serve
    app = serve.status().applications[APP]
    return app.deployments["DiTRollout"].replica_states.get("RUNNING", 0)


def test_killed_rollout_replica_every_request_answered_once_or_retryable(faults_graph, adapter):
    import ray

    from deployments.client import materialize
    [(name, namespace)] = _rollout_replica_actors()
    ids = [f"fault-{i}" for i in range(8)]
    answers: collections.Counter[str] = collections.Counter()
    failures: dict[str, list[ReplicaFailedError | StageUnavailableError]] = \
        collections.defaultdict(list)
    other: list[BaseException] = []

    def call(rid: str) -> None:
        """One attempt: the caller's whole path (graph call + fetching the outputs)."""
        try:
            [result] = faults_graph.rollout.remote(
                request(adapter, "a blue square in the center on a white background",
                        request_id=rid, steps=30, seeds=tuple(range(8)))).result(timeout_s=300)
            out = materialize(result)
        except (ReplicaFailedError, StageUnavailableError) as exc:
            failures[rid].append(exc)
            return
        except BaseException as exc:  # noqa: BLE001 -- anything untyped fails the test below
            other.append(exc)
            return
        answers[out.request_id] += 1

    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        futures = [pool.submit(call, rid) for rid in ids]
        wait_until_ongoing((name, namespace), 1)      # requests are queued / running in it
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        concurrent.futures.wait(futures, timeout=400)
    assert not other, [repr(e) for e in other]
    first_round = dict(failures)
    assert failures, "killing the only rollout replica mid-flight failed no request"
    for rid, errs in failures.items():
        for err in errs:
            assert err.retryable and err.request_id == rid, err
            assert err.field in ("rollout", "artifacts") or err.field.startswith("decoder."), err

    # Serve replaces the replica; the caller retries exactly the failed ids
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and _running_rollout_replicas() < 1:
        time.sleep(1.0)
    assert _running_rollout_replicas() == 1
    assert _rollout_replica_actors() != [(name, namespace)]          # a new actor
    pending = [rid for rid in ids if answers[rid] == 0]
    for attempt in range(5):
        if not pending:
            break
        for rid in pending:
            call(rid)
        pending = [rid for rid in ids if answers[rid] == 0]
    assert not other, [repr(e) for e in other]
    assert dict(answers) == {rid: 1 for rid in ids}, (dict(answers), dict(failures))
    print(f"replica killed: {len(first_round)}/{len(ids)} requests failed with "
          f"ReplicaFailedError ({sorted({e.field for v in first_round.values() for e in v})}), "
          f"all answered exactly once after retry")


def test_ingress_dying_after_answering_loses_no_outputs_and_the_release_lands(faults_graph,
                                                                              adapter):
    """The outputs are fetched before the release; the ingress replica that answered dies before
    the release is sent: the outputs survive it (the holder is not the ingress), the release
    reaches its replacement, and the holder drops this request's stage outputs (the trainer's
    step goes on, nothing left held)."""
    import ray

    from deployments.client import RolloutClient
    from deployments.objects import get_object_holder, holder_name
    holder = get_object_holder(holder_name(APP), create=False)
    before = ray.get(holder.count.remote())
    response = faults_graph.rollout.remote([request(adapter, "a red circle at the top left on "
                                                    "a black background", request_id="ing-1")])
    [result] = response.result(timeout_s=300)
    assert ray.get(holder.count.remote()) > before           # the stages' outputs are held
    [(name, namespace)] = replica_actors(APP, "RolloutGraph")
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    [out] = RolloutClient(faults_graph).collect(response)
    assert out.request_id == "ing-1" and out.artifacts["image"].data.shape[0] == 2
    assert ray.get(holder.count.remote()) == before
    assert replica_actors(APP, "RolloutGraph") != [(name, namespace)]   # a new ingress answered


def test_release_in_flight_on_a_dying_ingress_is_resent_to_its_replacement(ray_cluster,
                                                                           tmp_path):
    """The release that reached an ingress replica dies with it (ActorDiedError); the client
    sends it again, Serve's replacement replica answers, and collect returns the outputs."""
    from ray import serve

    from deployments.client import RolloutClient
    from tests.serve_utils import IngressDyingInRelease
    marker = tmp_path / "released_once"
    handle = serve.run(serve.deployment(IngressDyingInRelease).bind(str(marker)),
                       name="dying_ingress", route_prefix=None)
    try:
        assert RolloutClient(handle).collect(handle.rollout.remote([])) == []
        assert marker.exists()                            # the first release killed a replica
    finally:
        serve.delete("dying_ingress")
