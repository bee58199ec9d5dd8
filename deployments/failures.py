"""What a replica's death looks like to its caller, and the typed error it becomes.

The ingress maps a stage replica's death to ReplicaFailedError (retryable); the trainer's client
uses the same test on the ingress itself (a release lost with the replica it reached is resent).
Whoever sends again waits by one RetryBudget.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError
from ray.serve.exceptions import RayServeException

from contract import ReplicaFailedError

# A replica died mid-call, or an object it owned (a rollout's latents) died with it.
_REPLICA_DIED = (ActorDiedError, ActorUnavailableError, RayActorError, ObjectLostError)


def replica_died(exc: BaseException) -> bool:
    """True when `exc` means a replica (or an object it owned) is gone. Serve raises a
    RayServeException caused by ActorDiedError when an upstream stage of a chained call died."""
    return (isinstance(exc, _REPLICA_DIED)
            or isinstance(exc, RayServeException) and isinstance(exc.__cause__, _REPLICA_DIED))


def replica_failed(stage: str, exc: BaseException, request_id: str) -> ReplicaFailedError:
    """The typed, retryable error for a request lost with a replica (or its objects)."""
    return ReplicaFailedError(f"a {stage} replica died before the request was answered; "
                              "retry the request", field=stage, actual=type(exc).__name__,
                              request_id=request_id)


@dataclass(frozen=True)
class RetryBudget:
    """Send again after a retryable failure: wait min(k x step_s, max_step_s) before attempt
    k + 1, for as long as `budget_s` seconds have not passed since the first attempt."""

    step_s: float
    max_step_s: float
    budget_s: float

    def wait(self, attempt: int) -> None:
        time.sleep(min(self.step_s * attempt, self.max_step_s))

    def spent(self, started: float) -> bool:
        """`started`: time.monotonic() at the first attempt."""
        return time.monotonic() - started > self.budget_s
