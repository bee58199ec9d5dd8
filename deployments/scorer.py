"""Scorer stage: one deployment per scorer family.

Each call scores one request's samples as soon as its decoded media exists (so rewards overlap
the rollout of other requests); concurrent calls are micro-batched with @serve.batch. The scorer
fetches the decoded artifacts it reads from the object store itself; a latent, a video without fps
or audio without a sample rate is refused with a typed error by the scorer's media checks.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any, Mapping, Sequence

import torch
from ray import serve

from contract import (InvalidRequestError, MediaArtifact, MissingArtifactError,
                      NonFiniteOutputError, ScorerOutput, StageOutput, UnscorableInputError)
from deployments.config import ScorerStage
from deployments.memory import guard_replica_memory
from deployments.metrics import StageMetrics
from deployments.microbatch import run_isolated
from rewards.base import ChecksPrompts, ScoreRequest
from rewards.groupwise import groups_of
from rewards.registry import build_scorer


def _concat(requests: Sequence[ScoreRequest]) -> ScoreRequest:
    names = requests[0].artifacts.keys()
    artifacts = {}
    for name in names:
        first = requests[0].artifacts[name]
        data = torch.cat([r.artifacts[name].data for r in requests])
        artifacts[name] = MediaArtifact(first.spec, data, first.metadata)
    return ScoreRequest(artifacts=artifacts,
                        prompts=tuple(p for r in requests for p in r.prompts),
                        metadata=tuple(m for r in requests for m in r.metadata),
                        groups=groups_of(requests))


def _finite_or_error(output: ScorerOutput) -> ScorerOutput | NonFiniteOutputError:
    """One request's scores, or the error that fails that request alone when a score of a
    scored sample is NaN or Inf (the scorer's fault: never a reward, never the client's 4xx)."""
    for name, values in output.scores.items():
        for i, value in enumerate(values):
            if value is not None and not math.isfinite(value):
                return NonFiniteOutputError(f"scorer {output.scorer!r} produced a non-finite "
                                            "score", field=f"scores.{name}[{i}]",
                                            expected="finite", actual=str(value))
    return output


def _split(output: ScorerOutput, sizes: Sequence[int]) -> list[ScorerOutput]:
    out, start = [], 0
    for n in sizes:
        sl = slice(start, start + n)
        out.append(ScorerOutput(output.scorer, {k: v[sl] for k, v in output.scores.items()},
                                output.status[sl], output.reasons[sl], output.metadata))
        start += n
    return out


class _Pending:
    """One call's ScoreRequest on its way through the micro-batch, emptied once scored: Serve's
    batch loop keeps its last batch's arguments alive until the next batch arrives, which would
    keep the decoded media pinned in the object store after the graph released them."""

    __slots__ = ("request",)

    def __init__(self, request: ScoreRequest):
        self.request: ScoreRequest | None = request


def _batch_key(request: ScoreRequest) -> tuple:
    return tuple((n, tuple(a.data.shape[1:]), a.fps, a.sample_rate)
                 for n, a in sorted(request.artifacts.items()))


class ScorerServer:
    def __init__(self, spec: ScorerStage):
        self.memory_guard = guard_replica_memory(f"Scorer_{spec.name}")
        self.spec = spec
        self.scorer = build_scorer(spec.scorer)
        self.metrics = StageMetrics(f"scorer:{spec.name}")
        self._score_batch.set_max_batch_size(spec.max_batch_size)
        self._score_batch.set_batch_wait_timeout_s(spec.batch_wait_timeout_s)

    async def primary(self) -> str:
        return self.scorer.primary

    async def checks_prompts(self) -> bool:
        """Whether this scorer declares a prompt check (rewards.base.ChecksPrompts)."""
        return isinstance(self.scorer, ChecksPrompts)

    async def check_prompts(self, prompts: Sequence[str],
                            request_ids: Sequence[str] | None = None) -> None:
        """The scorer's own prompt check on each prompt: UnscorableInputError naming the first
        one it cannot read (field `prompts[i]`, and its request id)."""
        if not isinstance(self.scorer, ChecksPrompts):
            return
        for i, text in enumerate(prompts):
            try:
                self.scorer.check_prompt(text)
            except InvalidRequestError as err:      # the hook's contract: the client's text
                raise UnscorableInputError(f"required scorer {self.spec.name!r} cannot read this "
                                           f"prompt: {err.message}", field=f"prompts[{i}]",
                                           expected=err.expected, actual=err.actual,
                                           request_id=request_ids[i] if request_ids else None
                                           ) from None

    async def score(self, *decoded: StageOutput, prompt: str, metadata: Mapping[str, Any],
                    seeds: Sequence[int]) -> ScorerOutput:
        """One request's samples: its prompt and metadata (the request's own, plus its condition
        media by role) shared by every sample, each sample's metadata adding its seed -- built
        here, not per sample on the ingress's event loop."""
        prompts = (prompt,) * len(seeds)
        metadata = tuple(dict(metadata, seed=seed) for seed in seeds)
        handles = {n: h for out in decoded for n, h in out.artifacts.items()}
        missing = [n for n in self.spec.inputs if n not in handles]
        if missing:
            raise MissingArtifactError(f"scorer {self.spec.name!r} did not receive its inputs",
                                       field=f"{self.spec.name}.inputs", expected=missing,
                                       actual=sorted(handles))
        arts = await asyncio.gather(*(handles[n].ref for n in self.spec.inputs))
        # one call = one request = one prompt group (what groupwise scorers compare within)
        pending = _Pending(ScoreRequest(artifacts=dict(zip(self.spec.inputs, arts)),
                                        prompts=tuple(prompts), metadata=tuple(metadata),
                                        groups=(len(prompts),)))
        del arts
        try:
            result = await self._score_batch(pending)
        finally:
            pending.request = None
        if isinstance(result, BaseException):
            raise result
        return result

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)   # set from the config
    async def _score_batch(self, pending: list[_Pending]) -> list[ScorerOutput | Exception]:
        """Micro-batch: requests with the same media shapes are scored in one call. A group that
        raises is re-scored request by request, so one bad request fails only itself (its
        exception is returned in its slot and raised by `score`)."""
        async def run(group: list[ScoreRequest]) -> list[ScorerOutput]:
            if len(group) == 1:
                return [await self._score_rows(group[0])]
            return _split(await self._score_rows(_concat(group)),
                          [len(r.prompts) for r in group])
        results = await run_isolated([p.request for p in pending], _batch_key, run)
        return [r if isinstance(r, Exception) else _finite_or_error(r) for r in results]

    async def _score_rows(self, request: ScoreRequest) -> ScorerOutput:
        with self.metrics.track(len(request.prompts)):
            return await asyncio.to_thread(self.scorer.score, request)
