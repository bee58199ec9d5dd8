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
    """

    artifacts: Mapping[str, MediaArtifact]
    prompts: tuple[str, ...]
    metadata: tuple[Mapping[str, Any], ...] = field(default=())


@runtime_checkable
class Scorer(Protocol):
    name: str
    required_artifacts: tuple[str, ...]     # artifact names it reads (decoded)
    primary: str                            # the named score used as this scorer's reward

    def score(self, request: ScoreRequest) -> ScorerOutput:
        """Scores per sample. Raises a typed error for media it cannot read (latent, no fps...)."""
        ...
