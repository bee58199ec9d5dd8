"""Typed errors. Each names the field, the expected and actual value and the request id.

`RolloutError.to_dict()` is the JSON error body HTTP callers receive:
{"error": {"type", "field", "message", ...}}. `http_status` says which 4xx/5xx it maps to.
"""
from __future__ import annotations

from typing import Any


class RolloutError(Exception):
    http_status = 400
    retryable = False

    def __init__(self, message: str, *, field: str | None = None, expected: Any = None,
                 actual: Any = None, request_id: str | None = None):
        self.message = message
        self.field = field
        self.expected = expected
        self.actual = actual
        self.request_id = request_id
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.message]
        if self.field is not None:
            parts.append(f"field={self.field}")
        if self.expected is not None:
            parts.append(f"expected={self.expected!r}")
        if self.actual is not None:
            parts.append(f"actual={self.actual!r}")
        if self.request_id is not None:
            parts.append(f"request_id={self.request_id}")
        return "; ".join(parts)

    def __reduce__(self):  # keep the fields across Ray's pickling of exceptions
        return (_rebuild, (type(self), self.message, self.field, self.expected, self.actual,
                           self.request_id))

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": type(self).__name__, "field": self.field,
                                "message": self.message}
        if self.expected is not None:
            body["expected"] = _jsonable(self.expected)
        if self.actual is not None:
            body["actual"] = _jsonable(self.actual)
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return {"error": body}


def _rebuild(cls, message, field, expected, actual, request_id):
    return cls(message, field=field, expected=expected, actual=actual, request_id=request_id)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


# --- request validation (4xx) -------------------------------------------------------------
class InvalidRequestError(RolloutError):
    """A field has a value the contract does not allow."""


class DuplicateInputError(InvalidRequestError):
    """Two media inputs claim the same (modality, role), or two artifacts share a name."""


class ConflictingInputError(InvalidRequestError):
    """Two aliases of one condition disagree (exact shape/value equality, never broadcasting)."""


class UndeclaredArtifactError(InvalidRequestError):
    """A requested artifact name is not declared by the adapter's IOSpec."""


class LimitExceededError(InvalidRequestError):
    """A size the request asks for is beyond the configured limit."""
    http_status = 413


class FieldValidationError(InvalidRequestError):
    """A field of an HTTP body has the wrong type or value (pydantic's first error, named)."""
    http_status = 422


class UnsupportedMediaTypeError(InvalidRequestError):
    """An HTTP body whose Content-Type is not application/json (a browser's form or text POST
    needs no CORS preflight; a JSON one does)."""
    http_status = 415


class MisdirectedRequestError(InvalidRequestError):
    """An HTTP request whose Host is not one the service answers (DNS rebinding)."""
    http_status = 421


class NotFoundError(InvalidRequestError):
    """An HTTP path the service does not serve (routes match exactly)."""
    http_status = 404


class MethodNotAllowedError(InvalidRequestError):
    """A served HTTP path asked with another method."""
    http_status = 405


class NonFiniteError(InvalidRequestError):
    """A tensor holds NaN or Inf."""


class MediaFormatError(InvalidRequestError):
    """Wrong dtype, layout, rank, or a missing fps / sample rate for a media tensor."""


class MalformedBodyError(InvalidRequestError):
    """An HTTP body that is not UTF-8 JSON of one object: bad encoding or syntax, nesting deeper
    than the parser's bound, a duplicated key, or a number outside what JSON can carry."""


class UnscorableInputError(InvalidRequestError):
    """A required scorer cannot read an input the client supplied (a prompt outside the
    verifier's vocabulary, condition media it cannot parse): the client's fault, never 5xx."""
    http_status = 422


class GroupSplitError(InvalidRequestError):
    """A groupwise scorer was handed part of a prompt group, or rows without their groups
    (rewards/groupwise.py): it compares each sample with its whole group only."""
    http_status = 422


# --- output validation (server-side, 5xx) --------------------------------------------------
class OutputContractError(RolloutError):
    """A stage produced output that breaks the contract (never substituted, always raised)."""
    http_status = 500


class NonFiniteOutputError(OutputContractError):
    """A stage produced NaN or Inf (a velocity, a sample, a log-prob, decoded media, a reward)
    for a request whose input passed validation: the server's fault, that request's alone."""


class MissingArtifactError(OutputContractError):
    """Declared and requested, but the producer did not return it."""


class UnexpectedArtifactError(OutputContractError):
    """Returned but not declared (or not requested)."""


# --- runtime -------------------------------------------------------------------------------
class QueueFullError(RolloutError):
    """The engine queue is at its bound. Retry later."""
    http_status = 503
    retryable = True


class RequestCancelledError(RolloutError):
    http_status = 499


class ReplicaFailedError(RolloutError):
    """The replica serving the request died; the request was not answered and may be retried."""
    http_status = 503
    retryable = True


class StageUnavailableError(RolloutError):
    """No replica of a stage took the request in time (its node was lost, its replicas are
    restarting, or the policy store is being restored): nothing ran; retry later."""
    http_status = 503
    retryable = True


class LoRAMapError(RolloutError):
    """A LoRA could not be mapped onto the rollout model (unknown target, zero matches, shape)."""
    http_status = 422


class PolicyVersionError(RolloutError):
    """A request names a policy version that is not resident / known, or is too stale."""
    http_status = 409


class EncoderVersionError(RolloutError):
    """An encoded prompt (a cache entry, a condition) made by text encoders of another version
    than the ones asked for: never served in their place."""
    http_status = 409


class ScorerFailedError(RolloutError):
    """A required scorer failed for a sample. Never turned into a reward of 0."""
    http_status = 502


class RemoteScorerError(RolloutError):
    """A remote scorer (an HTTP reward server, a VLM judge) timed out, answered an error status
    or a body that breaks its protocol, after its retries. Never turned into a reward of 0."""
    http_status = 502


class ConfigError(RolloutError):
    """A configuration value is invalid (raised at build time)."""


class DatasetError(ConfigError):
    """A prompt file that is missing, holds no prompts, or has a record that does not parse or
    names condition media that do not load; `field` is `<file>:<line>` (parquet: the row)."""


class StartupCheckError(RolloutError):
    """A trainer start-up check failed (time convention, LoRA map, token ids)."""
    http_status = 500
