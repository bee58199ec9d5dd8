"""Pairwise preference reward (Pref-GRPO, arXiv 2508.20751): a VLM judge compares two samples of
a prompt group at a time; each sample's win rate in its group is its reward.

For a group of n samples (rewards/groupwise.py: whole groups only) every unordered pair (i, j),
i < j, is one chat completion on the judge's OpenAI-compatible server (what vLLM / sglang serve):
both images, labelled by their index in the group, and the prompt; the judge answers the index
of the better one (constrained to the pair's two labels with `choices`, vLLM's
`structured_outputs` / `guided_choice`). Then, as the paper defines it,
    win_rate_i = (1 / (n - 1)) * sum_{j != i} [i preferred over j]        in [0, 1].
This is Pref-GRPO's `_pairwise_win_rate` (CodeGoat24/Pref-GRPO,
fastvideo/rewards/unifiedreward_think.py): every pair once, wins over comparisons. An answer
naming neither sample of its pair (a judge answering for another pair) raises RemoteScorerError
naming the pair and the answer. An answer with no index is `undecided`: FAIL (default) fails the
pair's two samples (FAILED -> a required scorer's ScorerFailedError, an optional one's MISSING);
TIE counts half a win to each, as Pref-GRPO does.
"""
from __future__ import annotations

import itertools
import re
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import ConfigError, Modality, ScorerOutput, ScoreStatus
from contract.errors import RemoteScorerError
from rewards.base import ScoreRequest
from rewards.groupwise import group_slices
from rewards.http_client import RetryPolicy
from rewards.media import require_decoded
from rewards.vlm_judge import ChoiceField, answer_text, chat_body, chat_client


class Undecided(str, Enum):
    """What an answer naming no sample of its pair counts as."""

    FAIL = "fail"     # the pair's two samples fail (never a made-up outcome)
    TIE = "tie"       # half a win each (Pref-GRPO's rule)

DEFAULT_PAIR_TEMPLATE = (
    "Two AI-generated images for the prompt: \"{prompt}\". The first is image {first}, the "
    "second is image {second}. Which one matches the prompt better and looks better? Answer "
    "with its number only.")


class VLMPairwiseScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = "vlm_pairwise"
    base_url: str = Field(description="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the served model name")
    api_key_env: str | None = Field(None, description="env var holding a bearer token")
    artifact: str = "image"
    system_prompt: str | None = None
    template: str = Field(DEFAULT_PAIR_TEMPLATE, description="user text; {prompt}, {first} and "
                          "{second} (the two samples' indices in the group)")
    constrain: bool = Field(True, description="constrain the answer to the pair's two indices")
    choice_field: ChoiceField = ChoiceField.STRUCTURED_OUTPUTS
    undecided: Undecided = Undecided.FAIL
    max_pairs: int = Field(256, ge=1, description="judge calls per group at most: n(n-1)/2")
    max_tokens: int = Field(8, ge=1, le=4096)
    retry: RetryPolicy = Field(default_factory=lambda: RetryPolicy(timeout_s=120.0))

    @model_validator(mode="after")
    def _check(self) -> "VLMPairwiseScorerConfig":
        for key in ("{prompt}", "{first}", "{second}"):
            if key not in self.template:
                raise ValueError(f"template must contain {key}")
        return self


def win_rates(n: int, winners: dict[tuple[int, int], int | None],
              undecided: Undecided = Undecided.FAIL) -> list[float | None]:
    """Each sample's share of its n - 1 comparisons won. An undecided comparison (None): under
    FAIL its two samples get None, under TIE half a win each."""
    wins = [0.0] * n
    failed: set[int] = set()
    for (i, j), w in winners.items():
        if w is not None:
            wins[w] += 1
        elif undecided is Undecided.TIE:
            wins[i] += 0.5
            wins[j] += 0.5
        else:
            failed.update((i, j))
    return [None if k in failed else wins[k] / (n - 1) for k in range(n)]


class VLMPairwiseScorer:
    primary = "win_rate"
    groupwise = True

    def __init__(self, config: VLMPairwiseScorerConfig):
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        self._client, self._pool = chat_client(config, "pair")

    def body(self, prompt: str, first: tuple[int, Any], second: tuple[int, Any]) -> dict:
        cfg = self.config
        text = cfg.template.format(prompt=prompt, first=first[0], second=second[0])
        labels = [str(first[0]), str(second[0])] if cfg.constrain else None
        return chat_body(cfg, [first[1], second[1]], text, labels)

    def winner(self, answer: str, pair: tuple[int, int], group: int) -> int | None:
        """The preferred sample of `pair` (group-local indices), None when the answer names no
        index; RemoteScorerError when it names a sample outside the pair."""
        match = re.search(r"-?\d+", answer)
        if match is None:
            return None
        label = int(match.group(0))
        if label not in pair:
            raise RemoteScorerError(
                f"judge {self.name!r} answered for another pair: {answer[:200]!r}",
                field=f"{self.name}.groups[{group}].pairs[{pair[0]},{pair[1]}]",
                expected=list(pair), actual=label)
        return label

    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, Modality.IMAGE, self.name)
        slices = group_slices(request, art.batch_size, self.name)
        for g, sl in enumerate(slices):
            n = sl.stop - sl.start
            if n * (n - 1) // 2 > cfg.max_pairs:
                raise ConfigError("a group needs more judge calls than max_pairs",
                                  field=f"{self.name}.max_pairs",
                                  expected=f">= {n * (n - 1) // 2} (group {g} of {n})",
                                  actual=cfg.max_pairs)
        data = art.data.cpu().numpy()
        jobs = []                        # (group, (i, j) local, body)
        for g, sl in enumerate(slices):
            n = sl.stop - sl.start
            for i, j in itertools.combinations(range(n), 2):
                body = self.body(request.prompts[sl.start], (i, data[sl.start + i]),
                                 (j, data[sl.start + j]))
                jobs.append((g, (i, j), body))
        answers = list(self._pool.map(self._client.post, [b for _, _, b in jobs]))
        winners: list[dict[tuple[int, int], int | None]] = [{} for _ in slices]
        for (g, pair, _), ans in zip(jobs, answers):
            winners[g][pair] = self.winner(answer_text(ans, self.name), pair, g)
        rates: list[float | None] = []
        reasons: list[str | None] = []
        for g, sl in enumerate(slices):
            for k, rate in enumerate(win_rates(sl.stop - sl.start, winners[g],
                                               cfg.undecided)):
                rates.append(rate)
                reasons.append(None if rate is not None else
                               f"a judge answer for a pair of sample {k} named no index")
        return ScorerOutput(
            scorer=self.name, scores={"win_rate": tuple(rates)},
            status=tuple(ScoreStatus.OK if r is not None else ScoreStatus.FAILED for r in rates),
            reasons=tuple(reasons),
            metadata={"pairs": len(jobs)})
