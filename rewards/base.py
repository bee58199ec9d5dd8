"""The Scorer protocol: a batch of decoded artifacts + prompts -> named scores and a status each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from contract import MediaArtifact, ScorerOutput


@dataclass(frozen=True)
class ScoreRequest:
    """What a scorer receives for B samples.

    artifacts: name -> artifact with data (B, ...); prompts: B prompt texts;
    metadata: B per-sample dicts (e.g. condition frames for FL2VA fidelity, seeds).
    groups: sizes of the consecutive prompt groups the B samples form (the scorer stage gives
    each request's rows as one group); () = not stated, which only groupwise scorers refuse
    (rewards/groupwise.py).
    """

    artifacts: Mapping[str, MediaArtifact]
    prompts: tuple[str, ...]
    metadata: tuple[Mapping[str, Any], ...] = field(default=())
    groups: tuple[int, ...] = field(default=())


@runtime_checkable
class Scorer(Protocol):
    name: str
    required_artifacts: tuple[str, ...]     # artifact names it reads (decoded, or a latent)
    primary: str                            # the named score used as this scorer's reward

    def score(self, request: ScoreRequest) -> ScorerOutput:
        """Scores per sample. Raises a typed error for media it cannot read (latent, no fps...);
        UnscorableInputError when what it cannot read came from the client (its prompt, its
        condition media), so the request fails as the client's 4xx, not a scorer's 5xx."""
        ...


@runtime_checkable
class ChecksPrompts(Protocol):
    """Optional scorer hook: `check_prompt(text)` raises UnscorableInputError for a prompt this
    scorer cannot read (e.g. a caption outside a verifier's vocabulary). When the scorer is
    required, the ingress runs it on every prompt before any stage, so such a request is a 4xx
    at once, not a finished rollout failing in the scorer. It must be cheap (no model call)."""

    def check_prompt(self, text: str) -> None:
        ...
