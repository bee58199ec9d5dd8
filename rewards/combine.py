"""Multi-reward: run scorers under a timeout and failure policy, then weight them per sample.

total_i = sum_{s present for i} w_s * norm_s(r_{s,i}) / sum_{s present for i} w_s

A scorer is *present* for sample i when its status is OK. An OPTIONAL scorer that failed or timed
out is recorded as MISSING with its reason and left out of that sample's sum (weights renormalised
over the present ones). A REQUIRED scorer that failed raises ScorerFailedError naming the scorer
and sample; a sample with no scorer present is an error too. Nothing is ever replaced by 0.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from enum import Enum
from typing import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import (ConfigError, OutputContractError, RewardReport, RolloutError,
                      ScorerFailedError, ScorerOutput, ScoreStatus)
from rewards.base import Scorer, ScoreRequest


class ScorerPolicy(str, Enum):
    REQUIRED = "required"
    OPTIONAL = "optional"


class NormKind(str, Enum):
    NONE = "none"            # use the score as it is
    MIN_MAX = "min_max"      # (r - low) / (high - low), clipped to [0, 1] if clip
    RUNNING_Z = "running_z"  # (r - mean) / max(std, min_std), moments over all batches seen


class Normalization(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: NormKind = NormKind.NONE
    low: float | None = None
    high: float | None = None
    clip: bool = True
    min_std: float = Field(1e-6, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "Normalization":
        if self.kind == NormKind.MIN_MAX and (self.low is None or self.high is None
                                              or not self.high > self.low):
            raise ValueError(f"min_max needs low < high, got low={self.low}, high={self.high}")
        return self


class ScorerWeight(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0)
    policy: ScorerPolicy = ScorerPolicy.REQUIRED
    timeout_s: float = Field(60.0, gt=0)
    score: str | None = Field(None, description="named score to use; default: scorer.primary")
    normalization: Normalization = Normalization()


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scorers: dict[str, ScorerWeight] = Field(min_length=1)


class RunningMoments:
    """Running mean/variance over every score seen (Welford's algorithm)."""

    def __init__(self) -> None:
        self.count, self.mean, self._m2 = 0, 0.0, 0.0

    def update(self, values: Sequence[float]) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.count) if self.count else 0.0


def combine(outputs: Mapping[str, ScorerOutput], config: RewardConfig, *,
            primaries: Mapping[str, str] | None = None,
            moments: Mapping[str, RunningMoments] | None = None) -> RewardReport:
    """Weighted per-sample total of the configured scorers' outputs (see module docstring).

    primaries: scorer -> named score used when the config names none (run_scorers passes
    each scorer's `primary`). moments: state for RUNNING_Z scorers (updated in place).
    """
    extra = sorted(set(outputs) - set(config.scorers))
    if extra:
        raise ConfigError("outputs from scorers that the reward config does not name",
                          field="rewards.scorers", expected=sorted(config.scorers), actual=extra)
    absent = sorted(set(config.scorers) - set(outputs))
    if absent:
        raise OutputContractError("no output for configured scorers", field="rewards.by_scorer",
                                  expected=sorted(config.scorers), actual=sorted(outputs))
    sizes = {name: out.batch_size for name, out in outputs.items()}
    if len(set(sizes.values())) != 1:
        raise OutputContractError("scorers returned different batch sizes",
                                  field="rewards.by_scorer", actual=sizes)
    batch = next(iter(sizes.values()))
    recorded: dict[str, ScorerOutput] = {}
    values: dict[str, list[float | None]] = {}
    for name, entry in config.scorers.items():
        out = _check_output(name, outputs[name])
        key = _score_key(name, out, entry, primaries)
        status, reasons = list(out.status), list(out.reasons)
        for i, st in enumerate(status):
            if st == ScoreStatus.OK:
                continue
            if entry.policy == ScorerPolicy.REQUIRED:
                raise ScorerFailedError(f"required scorer {name!r} failed for sample {i}: "
                                        f"{reasons[i]}", field=f"rewards.{name}.samples[{i}]",
                                        actual=st.value)
            status[i] = ScoreStatus.MISSING
        recorded[name] = ScorerOutput(scorer=out.scorer, scores=out.scores, status=tuple(status),
                                      reasons=tuple(reasons), metadata=out.metadata)
        values[name] = _normalise(name, [out.scores[key][i] if status[i] == ScoreStatus.OK
                                         else None for i in range(batch)],
                                  entry.normalization, moments)
    total = []
    for i in range(batch):
        present = [n for n in config.scorers if values[n][i] is not None]
        if not present:
            reasons = {n: recorded[n].reasons[i] for n in config.scorers}
            raise ScorerFailedError(f"sample {i} has no scorer present: {reasons}",
                                    field=f"rewards.samples[{i}]", actual=reasons)
        w = sum(config.scorers[n].weight for n in present)
        total.append(sum(config.scorers[n].weight * values[n][i] for n in present) / w)
    return RewardReport(by_scorer=recorded, total=tuple(total),
                        weights={n: e.weight for n, e in config.scorers.items()},
                        values={n: tuple(v) for n, v in values.items()})


class RewardCombiner:
    """combine() with its running moments held across batches (for RUNNING_Z normalisation)."""

    def __init__(self, config: RewardConfig):
        self.config = config
        self.moments = {n: RunningMoments() for n, e in config.scorers.items()
                        if e.normalization.kind == NormKind.RUNNING_Z}

    def __call__(self, outputs: Mapping[str, ScorerOutput],
                 primaries: Mapping[str, str] | None = None) -> RewardReport:
        return combine(outputs, self.config, primaries=primaries, moments=self.moments)


def run_scorers(scorers: Sequence[Scorer], request: ScoreRequest, config: RewardConfig, *,
                combiner: RewardCombiner | None = None) -> RewardReport:
    """Call every scorer concurrently (one thread each) under its timeout, then combine.

    An OPTIONAL scorer that raises or times out becomes MISSING for every sample, with the reason.
    A REQUIRED one raises ScorerFailedError (the original error as __cause__). A timed-out call
    cannot be interrupted in Python: its thread is abandoned and its result ignored.
    """
    names = [s.name for s in scorers]
    if sorted(names) != sorted(config.scorers) or len(set(names)) != len(names):
        raise ConfigError("scorers must match the reward config one to one",
                          field="rewards.scorers", expected=sorted(config.scorers), actual=names)
    batch = len(request.prompts)
    pool = ThreadPoolExecutor(max_workers=len(scorers), thread_name_prefix="scorer")
    try:
        start = time.monotonic()
        futures = {s.name: pool.submit(s.score, request) for s in scorers}
        outputs: dict[str, ScorerOutput] = {}
        for s in scorers:
            entry = config.scorers[s.name]
            remaining = max(0.0, entry.timeout_s - (time.monotonic() - start))
            try:
                out = futures[s.name].result(timeout=remaining)
                if out.batch_size != batch:
                    raise OutputContractError(f"scorer {s.name!r} returned {out.batch_size} "
                                              f"samples for {batch}", field=f"rewards.{s.name}",
                                              expected=batch, actual=out.batch_size)
                outputs[s.name] = out
            except FutureTimeout:
                outputs[s.name] = policy_failure(s.name, entry, batch,
                                          f"timed out after {entry.timeout_s:g} s", None)
            except Exception as e:  # noqa: BLE001 -- any scorer failure goes through the policy
                outputs[s.name] = policy_failure(s.name, entry, batch, f"{type(e).__name__}: {e}", e)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    primaries = {s.name: s.primary for s in scorers}
    if combiner is not None:
        return combiner(outputs, primaries)
    return combine(outputs, config, primaries=primaries)


def policy_failure(name: str, entry: ScorerWeight, batch: int, reason: str,
                   cause: BaseException | None, request_id: str | None = None) -> ScorerOutput:
    """A scorer call that raised or timed out, under its policy: REQUIRED raises
    ScorerFailedError (cause attached); OPTIONAL becomes MISSING for every sample."""
    if entry.policy == ScorerPolicy.REQUIRED:
        err = ScorerFailedError(f"required scorer {name!r} failed for samples 0..{batch - 1}: "
                                f"{reason}", field=f"rewards.{name}.samples",
                                actual=getattr(cause, "field", None) or reason,
                                request_id=request_id)
        raise err from cause
    return ScorerOutput(scorer=name, scores={}, status=(ScoreStatus.MISSING,) * batch,
                        reasons=(reason,) * batch)


def _check_output(name: str, out: ScorerOutput) -> ScorerOutput:
    """A score is a finite float exactly where its status is OK, None elsewhere."""
    if len(out.reasons) != out.batch_size:
        raise OutputContractError(f"scorer {name!r}: reasons and status lengths differ",
                                  field=f"rewards.{name}.reasons", expected=out.batch_size,
                                  actual=len(out.reasons))
    for key, vals in out.scores.items():
        if len(vals) != out.batch_size:
            raise OutputContractError(f"scorer {name!r}: score {key!r} has {len(vals)} values",
                                      field=f"rewards.{name}.scores.{key}",
                                      expected=out.batch_size, actual=len(vals))
        for i, (v, st) in enumerate(zip(vals, out.status)):
            ok = st == ScoreStatus.OK
            if ok and (v is None or not math.isfinite(v)) or (not ok and v is not None):
                raise OutputContractError(f"scorer {name!r}: score {key!r} of sample {i} is {v} "
                                          f"with status {st.value}",
                                          field=f"rewards.{name}.scores.{key}[{i}]", actual=v)
    return out


def _score_key(name: str, out: ScorerOutput, entry: ScorerWeight,
               primaries: Mapping[str, str] | None) -> str | None:
    key = entry.score or (primaries or {}).get(name)
    if not any(st == ScoreStatus.OK for st in out.status):
        return key          # nothing to read (all MISSING / FAILED)
    if key is None:
        raise ConfigError(f"which score of {name!r} is the reward? set `score` in its config",
                          field=f"rewards.scorers.{name}.score", expected=sorted(out.scores))
    if key not in out.scores:
        raise ConfigError(f"scorer {name!r} has no score {key!r}",
                          field=f"rewards.scorers.{name}.score", expected=sorted(out.scores),
                          actual=key)
    return key


def _normalise(name: str, vals: list[float | None], norm: Normalization,
               moments: Mapping[str, RunningMoments] | None) -> list[float | None]:
    present = [v for v in vals if v is not None]
    if norm.kind == NormKind.NONE:
        return vals
    if norm.kind == NormKind.MIN_MAX:
        def f(v: float) -> float:
            x = (v - norm.low) / (norm.high - norm.low)
            return min(1.0, max(0.0, x)) if norm.clip else x
        return [None if v is None else f(v) for v in vals]
    if moments is None or name not in moments:
        raise ConfigError(f"scorer {name!r} uses running_z but no running moments were given "
                          "(use RewardCombiner)", field=f"rewards.scorers.{name}.normalization")
    m = moments[name]
    m.update(present)
    std = max(m.std, norm.min_std)
    return [None if v is None else (v - m.mean) / std for v in vals]
