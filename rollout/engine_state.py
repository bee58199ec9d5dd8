"""The embedded engine's state: per-request state, the persistent batch and the scheduler.

vLLM v1's split: `schedule` (pure) decides which requests run the next forward; the model runner
(EmbeddedEngine._forward) only runs it on `PersistentBatch.inputs`; the update step commits each
request's sampler step and writes its rows back into the batch in place.

A `PersistentBatch` holds the rows of every running request of one BatchKey, in admission order,
as tensors kept across steps: the state x, the conditions, the guidance scales, the media inputs
and a per-row sigma table with a per-row step index. They are rebuilt only when rows join
(admission), leave (a request finished or failed) or fork; a step writes its rows' new x in
place. A forward over all of the batch's requests reads the tensors as they are; a forward over
some of them (a row budget, a request taken out) gathers their rows.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from contract import Condition
from rollout.engine_api import EngineRequest, RolloutTree
from rollout.recorder import RowFork, SampleRecorder


@dataclass(frozen=True)
class BatchKey:
    """Rows may share one forward only when all of these agree."""

    state_shape: tuple[int, ...]          # per-row sampler state S
    guided: bool                          # CFG on (rows doubled with the unconditional branch)
    policy_version: str                   # LoRA version applied to the forward
    cond: tuple                           # Condition.batch_key(): names, per-row shapes, dtypes
    media: tuple                          # MediaCondition.batch_key(): frozen state / inputs


@dataclass
class RequestState:
    """Everything the loop holds for one request, prepared at admission (off the loop).

    cond / negative / inputs hold one row (the prompt, the media): the persistent batch repeats
    them per row. `forks` maps a step to the RowFork its rows take there (tree rollouts)."""

    request: EngineRequest
    future: concurrent.futures.Future
    key: BatchKey
    recorder: SampleRecorder              # step index, sampler per step, noise, trajectory
    model_times: torch.Tensor             # (N,) fp32 time actually fed to the model per step
    x: torch.Tensor                       # (B, *S) fp32 current sampler state
    cond: Condition                       # one row
    negative: Condition | None            # one row when CFG doubles the rows, else None
    inputs: dict[str, torch.Tensor]       # media inputs of the forward, one row each
    enqueued_at: float
    order: int                            # admission order (FIFO tie-break)
    forks: dict[int, RowFork] = field(default_factory=dict)
    tree: RolloutTree | None = None
    last_tick: int = -1                   # loop tick of its last step (fairness)
    started_at: float | None = None
    batch_rows: list[int] = field(default_factory=list)              # rows per forward it joined

    @property
    def request_id(self) -> str:
        return self.request.request.request_id

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def step(self) -> int:
        return self.recorder.step

    @property
    def num_steps(self) -> int:
        return self.recorder.num_steps

    @property
    def done(self) -> bool:
        return self.recorder.done

    @property
    def guidance_scale(self) -> float:
        return self.request.request.sampling.guidance_scale


@dataclass
class ForwardInputs:
    """The rows of one forward: (R, *S) x, (R,) sigma and scales, R-row conditions."""

    x: torch.Tensor
    sigma: torch.Tensor
    scales: torch.Tensor
    cond: Condition
    negative: Condition | None
    inputs: dict[str, torch.Tensor]


class PersistentBatch:
    """The rows of every running request of one BatchKey, kept across steps."""

    def __init__(self, key: BatchKey):
        self.key = key
        self.states: list[RequestState] = []
        self.offsets: dict[int, int] = {}         # id(state) -> its first row
        self._tensors: ForwardInputs | None = None
        self._sigma_table = torch.empty(0)        # (R, max N + 1) fp32, row r's schedule
        self._step = torch.empty(0, dtype=torch.long)   # (R,) row r's current step

    def __len__(self) -> int:
        return len(self.states)

    def add(self, state: RequestState) -> None:
        self.states.append(state)
        self._rebuild()

    def remove(self, state: RequestState) -> None:
        self.states.remove(state)
        self._rebuild()

    def rows_changed(self) -> None:
        """A request's row count changed (a fork): its rows are re-laid."""
        self._rebuild()

    def _rebuild(self) -> None:
        self.offsets, offset = {}, 0
        for state in self.states:
            self.offsets[id(state)] = offset
            offset += state.rows
        if not self.states:
            self._tensors = None
            return
        states = self.states
        x = torch.cat([s.x for s in states])
        for s in states:                          # each request's x is a view of the batch
            start = self.offsets[id(s)]
            s.x = x[start:start + s.rows]
        cond = Condition.cat([s.cond.expand_rows(s.rows) for s in states])
        negative = Condition.cat([s.negative.expand_rows(s.rows) for s in states]) \
            if self.key.guided else None
        inputs = {k: torch.cat([s.inputs[k].expand(s.rows, *s.inputs[k].shape[1:])
                                for s in states]) for k in states[0].inputs}
        scales = torch.cat([torch.full((s.rows,), s.guidance_scale) for s in states])
        width = max(s.recorder.sigmas.shape[0] for s in states)
        table = torch.zeros(offset, width, dtype=torch.float32, device=x.device)
        for s in states:
            start = self.offsets[id(s)]
            table[start:start + s.rows, :s.recorder.sigmas.shape[0]] = s.recorder.sigmas
        self._sigma_table = table
        self._step = torch.cat([torch.full((s.rows,), s.step, dtype=torch.long) for s in states])
        self._tensors = ForwardInputs(x, torch.empty(0), scales, cond, negative, inputs)

    def _rows_of(self, batch: list[RequestState]) -> torch.Tensor:
        return torch.cat([torch.arange(self.offsets[id(s)], self.offsets[id(s)] + s.rows)
                          for s in batch])

    def inputs(self, batch: list[RequestState]) -> ForwardInputs:
        """The forward's rows for `batch` (requests of this batch, in forward order)."""
        t = self._tensors
        every = len(batch) == len(self.states) and all(a is b for a, b in zip(batch, self.states))
        sigma = self._sigma_table.gather(1, self._step[:, None])[:, 0]             # (R,)
        if every:
            return ForwardInputs(t.x, sigma, t.scales, t.cond, t.negative, t.inputs)
        rows = self._rows_of(batch)
        return ForwardInputs(t.x[rows], sigma[rows], t.scales[rows], t.cond.index_select(rows),
                             None if t.negative is None else t.negative.index_select(rows),
                             {k: v[rows] for k, v in t.inputs.items()})

    def write(self, state: RequestState, x: torch.Tensor) -> None:
        """The update step: the request's rows take their new state in place."""
        start = self.offsets[id(state)]
        self._tensors.x[start:start + state.rows].copy_(x)
        self._step[start:start + state.rows] += 1


def schedule(batches: list[PersistentBatch], max_rows: int) -> list[RequestState]:
    """Pick the next forward's requests: the longest-waiting one, then the requests of its
    persistent batch in the same order (longest waiting first) up to max_rows rows.

    Pure: reads `last_tick`, `order`, `rows` only. Every request fits alone (the engine refuses
    requests with more rows than max_rows at submission).
    """
    running = [s for b in batches for s in b.states]
    if not running:
        return []
    head = min(running, key=lambda s: (s.last_tick, s.order))
    home = next(b for b in batches if b.key == head.key)
    batch, rows = [], 0
    for state in sorted(home.states, key=lambda s: (s.last_tick, s.order)):
        if rows + state.rows <= max_rows:
            batch.append(state)
            rows += state.rows
    return batch
