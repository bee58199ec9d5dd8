"""The trainer's side of the graph: one call from RolloutRequests to RolloutOutputs.

    client = RolloutClient.connect(address="auto", app_name="omni")
    outputs = client.rollout(requests)            # list[RolloutOutput], tensors fetched here

The graph returns handles (object refs); this client fetches the tensors straight from the object
store, so they never pass through the ingress, then tells the graph to release its copies.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Sequence

import ray
from ray import serve

from ray.exceptions import ObjectLostError, RayActorError

from contract import GraphResult, ReplicaFailedError, RolloutOutput, RolloutRequest
from deployments.failures import RetryBudget, replica_died

# Releasing is idempotent and the outputs are already fetched when it runs, so a release that
# lands on an ingress replica dying under it is sent again (Serve routes it to a live one once
# the death is known) until this budget is spent; then it fails typed and retryable.
RELEASE_RETRY = RetryBudget(step_s=1.0, max_step_s=10.0, budget_s=120.0)


def materialize(result: GraphResult) -> RolloutOutput:
    """Fetch a GraphResult's artifacts and trajectory from the object store."""
    names = list(result.artifacts)
    refs = [result.artifacts[n].ref for n in names]
    if result.trajectory is not None:
        refs.append(result.trajectory)
    try:
        values = ray.get(refs)
    except ObjectLostError as exc:     # the replica that produced them died since
        raise ReplicaFailedError("the outputs were lost with the replica that produced them; "
                                 "retry the request", field="artifacts",
                                 actual=type(exc).__name__, request_id=result.request_id) from exc
    trajectory = values.pop() if result.trajectory is not None else None
    return RolloutOutput(request_id=result.request_id, artifacts=dict(zip(names, values)),
                         trajectory=trajectory, policy_version=result.policy_version,
                         seeds=result.seeds, stop_reason=result.stop_reason,
                         rewards=result.rewards, metrics=dict(result.metrics),
                         metadata=({"encoded_token_ids": dict(result.encoded_token_ids)}
                                   if result.encoded_token_ids is not None else {}),
                         conditions=dict(result.conditions),     # by reference, unfetched
                         tree=result.tree)


class RolloutClient:
    def __init__(self, ingress_handle, rollout_handle=None):
        self.ingress = ingress_handle
        self.rollout_stage = rollout_handle

    @classmethod
    def connect(cls, app_name: str = "omni", address: str | None = "auto") -> "RolloutClient":
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        handle = serve.get_app_handle(app_name)
        rollout = serve.get_deployment_handle("DiTRollout", app_name=app_name)
        return cls(handle, rollout)

    def submit(self, requests: Sequence[RolloutRequest]):
        """Start a rollout; returns a DeploymentResponse (call `.result()` or `collect`)."""
        return self.ingress.rollout.remote(list(requests))

    def collect(self, response) -> list[RolloutOutput]:
        """Fetch the results' tensors, then let the graph release its copies."""
        try:
            results = response.result()
        except RayActorError as exc:
            raise _ingress_failed(exc) from exc
        return self._fetch_and_release(results)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        return self.collect(self.submit(requests))

    def conditions(self, prompts, unconditional: bool = False, media=None) -> list:
        """The encoder stage's encoding of each prompt as ConditionHandles (unfetched); `media`:
        per prompt its condition media by role (an edit's source image), or None."""
        return self.ingress.conditions.remote(list(prompts), unconditional,
                                              None if media is None else list(media)).result()

    async def rollout_async(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        """`rollout` from async code: the fetch and the release run in a thread, off the loop."""
        try:
            results = await self.submit(requests)
        except RayActorError as exc:
            raise _ingress_failed(exc) from exc
        return await asyncio.to_thread(self._fetch_and_release, results)

    def _fetch_and_release(self, results: Sequence[GraphResult]) -> list[RolloutOutput]:
        outputs = [materialize(r) for r in results]
        ids = [r.request_id for r in results]
        t0 = time.monotonic()
        for attempt in itertools.count(1):
            try:
                self.ingress.release.remote(ids).result()
                return outputs
            except Exception as exc:  # noqa: BLE001 -- anything but a replica death re-raises
                _resend_or_raise(exc, attempt, t0)
                RELEASE_RETRY.wait(attempt)
        raise AssertionError("unreachable")


def _resend_or_raise(exc: BaseException, attempt: int, t0: float) -> None:
    """Return when a failed release should be sent again: the ingress replica it reached died
    (`replica_died`) and the budget is not spent."""
    if not replica_died(exc):
        raise exc
    if RELEASE_RETRY.spent(t0):
        raise ReplicaFailedError(f"the ingress replicas died under {attempt} releases of fetched "
                                 "outputs; retry the requests", field="ingress",
                                 actual=type(exc).__name__) from exc


def _ingress_failed(exc: BaseException) -> ReplicaFailedError:
    """The ingress replica itself died mid-call (the stages' deaths come back typed from it)."""
    return ReplicaFailedError("the ingress replica died before answering; retry the requests",
                              field="ingress", actual=type(exc).__name__)
