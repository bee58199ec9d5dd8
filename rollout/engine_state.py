"""Per-request state of the embedded engine and the pure scheduling step (vLLM v1 style).

The engine loop is schedule -> execute -> update. `schedule` is a pure function of the running
set: it picks the request that has waited longest since its last step and packs every compatible
request behind it (same BatchKey) up to `max_rows`. Rows of one forward may sit at different
steps of different schedules; sigma is per row.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from contract import Condition
from rollout.engine_api import EngineRequest
from rollout.recorder import SampleRecorder


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
    """Everything the loop holds for one request (rows = its samples_per_prompt)."""

    request: EngineRequest
    future: concurrent.futures.Future
    key: BatchKey
    recorder: SampleRecorder              # step index, sampler per step, noise, trajectory
    model_times: torch.Tensor             # (N,) fp32 time actually fed to the model per step
    x: torch.Tensor                       # (B, *S) fp32 current sampler state
    cond: Condition                       # B rows (the prompt repeated per row)
    negative: Condition | None            # B rows when CFG doubles them, else None
    inputs: dict[str, torch.Tensor]       # media inputs of the forward, (B, ...) each
    enqueued_at: float
    order: int                            # admission order (FIFO tie-break)
    last_tick: int = -1                   # loop tick of its last step (fairness)
    started_at: float | None = None
    cancelled: bool = False
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


def schedule(running: list[RequestState], max_rows: int) -> list[RequestState]:
    """Pick the next forward's requests: the longest-waiting one, then compatible ones in order.

    Pure: reads `last_tick`, `order`, `key`, `rows` only. Every request in `running` fits alone
    (the engine refuses requests with more rows than max_rows at submission).
    """
    if not running:
        return []
    queue = sorted(running, key=lambda s: (s.last_tick, s.order))
    head = queue[0]
    batch, rows = [head], head.rows
    for state in queue[1:]:
        if state.key == head.key and rows + state.rows <= max_rows:
            batch.append(state)
            rows += state.rows
    return batch
