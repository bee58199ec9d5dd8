"""The embedded torch diffusion engine: a step-wise batching loop in its own thread.

Loop (vLLM v1 shape): admit -> schedule -> execute -> update.
  admit     new requests join the running set between denoising steps (initial noise per row seed)
  schedule  pick compatible requests (same adapter state shape, CFG on/off, LoRA version, condition
            shape) up to max_batch_rows rows; each keeps its own sigmas, window, seeds and step
  execute   one forward for all picked rows (CFG doubles them with the unconditional branch),
            then each request's own sampler step with its per-row seeded noise
  update    record the fp32 trajectory, finish / fail / cancel requests, resolve their futures
Torch forwards block, so the loop runs in a dedicated thread and `generate` awaits a future:
the caller's event loop (a Serve replica) stays responsive.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from typing import Mapping

import torch

from adapters.base import Components, DiffusionAdapter, TextCondition
from contract import (InvalidRequestError, LimitExceededError, MediaArtifact, QueueFullError,
                      ReplicaFailedError, RequestCancelledError, RolloutError, SamplerKind,
                      StopReason, Trajectory, collect_artifacts)
from diffusion.conventions import model_time, to_sigma_velocity
from diffusion.guidance import cfg_velocity
from diffusion.noise import initial_noise, row_noise
from diffusion.samplers import sampler_step
from diffusion.schedule import flow_match_sigmas
from rollout.config import EngineLimits
from rollout.engine_api import EngineRequest, EngineResult
from rollout.engine_state import BatchKey, RequestState, schedule
from rollout.lora import LoRASlots


def _cat_cond(conds: list[TextCondition]) -> TextCondition:
    pooled = None if conds[0].pooled is None else torch.cat([c.pooled for c in conds])
    return TextCondition(torch.cat([c.hidden for c in conds]), torch.cat([c.mask for c in conds]),
                         pooled)


def _repeat_cond(cond: TextCondition, rows: int, device: torch.device) -> TextCondition:
    if cond.hidden.shape[0] != 1:
        raise InvalidRequestError("an engine request carries one prompt condition (1, L, D)",
                                  field="cond.hidden", expected="(1, L, D)",
                                  actual=tuple(cond.hidden.shape))
    rep = lambda t: None if t is None else t.to(device).expand(rows, *t.shape[1:]).contiguous()
    return TextCondition(rep(cond.hidden), rep(cond.mask), rep(cond.pooled))


class EmbeddedEngine:
    """In-process engine over one adapter's inference-form transformer with LoRA slots."""

    def __init__(self, adapter: DiffusionAdapter, components: Components,
                 limits: EngineLimits | None = None, device: str = "cpu"):
        self.adapter = adapter
        self.components = components
        self.limits = limits or EngineLimits()
        self.device = torch.device(device)
        self.model = adapter.to_inference_form(components.transformer).to(self.device).eval()
        self.slots = LoRASlots(self.model, adapter.lora_map,
                               self.limits.max_resident_lora_versions)
        self._cv = threading.Condition()
        self._intake: list[tuple[EngineRequest, concurrent.futures.Future, float]] = []
        self._running: list[RequestState] = []
        self._cancel: set[str] = set()
        self._order = itertools.count()
        self._tick = 0
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{adapter.name}",
                                        daemon=True)
        self._thread.start()

    # ---- public API (DiffusionEngine) -----------------------------------------------------
    async def generate(self, request: EngineRequest) -> EngineResult:
        return await asyncio.wrap_future(self.submit(request))

    def submit(self, request: EngineRequest) -> concurrent.futures.Future:
        """Queue a request; returns a future. Full queue -> QueueFullError at once."""
        rid = request.request.request_id
        rows = request.request.sampling.samples_per_prompt
        if rows > self.limits.max_batch_rows:
            raise LimitExceededError("a request's rows must fit one forward", field="sampling.seeds",
                                     expected=f"<= {self.limits.max_batch_rows}", actual=rows,
                                     request_id=rid)
        self.slots.check(request.policy_version, rid)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                raise ReplicaFailedError("engine is shut down", request_id=rid)
            pending = len(self._intake) + len(self._running)
            if pending >= self.limits.max_queue_requests:
                raise QueueFullError("engine queue is full", field="queue",
                                     expected=f"< {self.limits.max_queue_requests} pending",
                                     actual=pending, request_id=rid)
            if any(r.request.request_id == rid for r, _, _ in self._intake) or \
                    any(s.request_id == rid for s in self._running):
                raise InvalidRequestError("request id is already in flight", field="request_id",
                                          actual=rid, request_id=rid)
            self._intake.append((request, future, time.perf_counter()))
            self._cv.notify()
        return future

    def cancel(self, request_id: str) -> bool:
        """Fail the request's future with RequestCancelledError before its next step."""
        with self._cv:
            known = any(r.request.request_id == request_id for r, _, _ in self._intake) or \
                any(s.request_id == request_id for s in self._running)
            if known:
                self._cancel.add(request_id)
                self._cv.notify()
            return known

    def load_lora(self, version: str, tensors: Mapping[str, torch.Tensor],
                  scale: float = 1.0, copy: bool = True) -> None:
        self.slots.load(version, tensors, scale, pinned=self._pinned(), copy=copy)

    def unload_lora(self, version: str) -> None:
        self.slots.unload(version, pinned=self._pinned())

    def versions(self) -> tuple[str, ...]:
        return self.slots.versions()

    def latest_version(self) -> str:
        return self.slots.latest

    async def sleep(self, level: int = 1) -> None:
        """Pause stepping between steps (requests stay queued); `wake_up` resumes."""
        with self._cv:
            self._paused = True

    async def wake_up(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    async def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _pinned(self) -> frozenset[str]:
        with self._cv:
            return frozenset({s.request.policy_version for s in self._running} |
                             {r.policy_version for r, _, _ in self._intake})

    # ---- loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():   # no autograd bookkeeping (version counters) on the hot path
            self._run_loop()
        self._shutdown_pending()

    def _run_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._intake or self._running)):
                    self._cv.wait()
                if self._stopped:
                    break
                intake, self._intake = self._intake, []
                cancel, self._cancel = self._cancel, set()
            for request, future, enqueued in intake:
                self._admit(request, future, enqueued)
            self._drop_cancelled(cancel)
            batch = schedule(self._running, self.limits.max_batch_rows)
            if not batch:
                continue
            try:
                self._execute(batch)
            except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests only
                for state in batch:
                    self._fail(state, exc)
                continue
            for state in batch:
                if state.done:
                    self._finish(state)

    def _admit(self, request: EngineRequest, future: concurrent.futures.Future,
               enqueued: float) -> None:
        if future.cancelled():                       # the caller gave up before admission
            return
        try:
            with self._cv:
                self._running.append(self._new_state(request, future, enqueued))
        except Exception as exc:  # noqa: BLE001 - bad input fails this request only
            future.set_exception(exc)

    def _new_state(self, request: EngineRequest, future: concurrent.futures.Future,
                   enqueued: float) -> RequestState:
        rr, adapter = request.request, self.adapter
        sampling, rid = rr.sampling, rr.request_id
        guided = sampling.guidance_scale != 1.0
        if guided and request.negative is None:
            raise InvalidRequestError("guidance_scale != 1 needs the unconditional condition",
                                      field="negative", expected="TextCondition", actual=None,
                                      request_id=rid)
        if sampling.sampler != SamplerKind.ODE and sampling.noise_level == 0 and \
                sampling.window[1] > sampling.window[0]:
            raise InvalidRequestError("a stochastic window needs noise_level > 0 (no log-prob "
                                      "exists at 0)", field="sampling.noise_level",
                                      expected="> 0", actual=0.0, request_id=rid)
        shape = tuple(adapter.state_shape(sampling))
        rows = sampling.samples_per_prompt
        sigmas = flow_match_sigmas(sampling.num_steps, adapter.schedule_shift)
        times = model_time(sigmas[:-1], adapter.time_convention, adapter.model_time_scale)
        media = {role: t.to(self.device) for role, t in request.media.items()}
        cond_latents = adapter.encode_media(self.components, sampling, media) if media else {}
        x = initial_noise(sampling.seeds, shape).to(self.device, torch.float32)   # (B, *S)
        x = adapter.apply_conditions(x, cond_latents)
        cond = _repeat_cond(request.cond, rows, self.device)
        negative = _repeat_cond(request.negative, rows, self.device) if guided else None
        if negative is not None and negative.hidden.shape != cond.hidden.shape:
            raise InvalidRequestError("conditional and unconditional prompts must have the same "
                                      "padded shape", field="negative.hidden",
                                      expected=tuple(cond.hidden.shape),
                                      actual=tuple(negative.hidden.shape), request_id=rid)
        key = BatchKey(shape, guided, request.policy_version, tuple(cond.hidden.shape[1:]),
                       None if cond.pooled is None else tuple(cond.pooled.shape[1:]),
                       tuple(sorted(r.value for r in cond_latents)))
        return RequestState(request, future, key, sigmas.to(self.device), times.to(self.device),
                            x, cond, negative, cond_latents, enqueued, next(self._order))

    def _execute(self, batch: list[RequestState]) -> None:
        self._tick += 1
        now = time.perf_counter()
        head = batch[0]
        x = torch.cat([s.x for s in batch])                                        # (R, *S)
        sigma = torch.cat([s.sigmas[s.step].expand(s.rows) for s in batch])        # (R,)
        t = torch.cat([s.model_times[s.step].expand(s.rows) for s in batch])       # (R,)
        cond = _cat_cond([s.cond for s in batch])
        media = {role: torch.cat([s.cond_latents[role].expand(s.rows, *s.cond_latents[role]
                                                                .shape[1:]) for s in batch])
                 for role in head.cond_latents}
        if head.key.guided:                       # [cond rows; uncond rows] in one forward
            x_in, t_in = torch.cat([x, x]), torch.cat([t, t])
            cond_in = _cat_cond([cond, _cat_cond([s.negative for s in batch])])
            media_in = {role: torch.cat([m, m]) for role, m in media.items()}
        else:
            x_in, t_in, cond_in, media_in = x, t, cond, media
        with self.slots.active(head.key.policy_version):
            raw = self.adapter.model_forward(self.model, x_in.to(self.model.dtype), t_in, cond_in,
                                             media_in or None)
        v_all = to_sigma_velocity(raw.float(), self.adapter.time_convention)       # (R or 2R, *S)
        rows = x.shape[0]
        offset = 0
        for state in batch:
            sl = slice(offset, offset + state.rows)
            offset += state.rows
            sampling = state.request.request.sampling
            v = v_all[sl]
            if head.key.guided:
                v = cfg_velocity(v_all[rows:][sl], v, sampling.guidance_scale)
            self._step(state, x[sl], v, sampling)
            state.batch_rows.append(rows)
            state.last_tick = self._tick
            if state.started_at is None:
                state.started_at = now

    def _step(self, state: RequestState, x: torch.Tensor, v: torch.Tensor, sampling) -> None:
        """One sampler step of one request (its own sigma, window, seeds, step index)."""
        j, kind = state.step, state.step_kind()
        start, end = state.window
        sigma = state.sigmas[j].expand(state.rows)
        sigma_next = state.sigmas[j + 1].expand(state.rows)
        if j == start:
            state.traj_latents.append(x.float().clone())
        noise = None
        if kind != SamplerKind.ODE:
            noise = row_noise(sampling.seeds, j, tuple(x.shape[1:])).to(x.device, torch.float32)
        out = sampler_step(kind, x, v, sigma, sigma_next, sampling.noise_level, noise)
        x_next = self.adapter.apply_conditions(out.prev_sample, state.cond_latents)
        if start <= j < end:
            state.log_probs.append(out.log_prob.float())
            state.traj_latents.append(x_next.float().clone())
        state.x = x_next
        state.step = j + 1

    # ---- update -----------------------------------------------------------------------------
    def _finish(self, state: RequestState) -> None:
        with self._cv:
            self._running.remove(state)
        try:
            result = self._result(state)
        except Exception as exc:  # noqa: BLE001 - an output-contract error fails this request
            if not state.future.done():
                state.future.set_exception(exc)
            return
        if not state.future.done():                  # not cancelled by the caller meanwhile
            state.future.set_result(result)

    def _result(self, state: RequestState) -> EngineResult:
        request, rid = state.request, state.request_id
        sampling = request.request.sampling
        named = self.adapter.split_state(state.x, sampling)
        produced = [MediaArtifact(self.adapter.io_spec[name], named[name].float())
                    for name in request.latent_artifacts if name in named]
        latents = collect_artifacts(self.adapter.io_spec, request.latent_artifacts, produced, rid)
        log_probs = torch.stack(state.log_probs, dim=1) if state.log_probs else \
            torch.zeros(state.rows, 0)                                              # (B, W)
        trajectory = Trajectory(
            latents=torch.stack(state.traj_latents, dim=1).cpu(),                  # (B, W+1, *S)
            sigmas=state.sigmas.cpu(), model_timesteps=state.model_times.cpu(),
            log_probs=log_probs.cpu(), window=state.window, sampler=sampling.sampler,
            noise_level=sampling.noise_level, guidance_scale=sampling.guidance_scale,
            seeds=sampling.seeds, policy_version=request.policy_version)
        done = time.perf_counter()
        started = state.started_at or done
        metrics = {"queue_time_s": started - state.enqueued_at,
                   "run_time_s": done - started, "steps": float(state.num_steps),
                   "forwards": float(len(state.batch_rows)),
                   "batch_rows_mean": sum(state.batch_rows) / max(len(state.batch_rows), 1),
                   "batch_rows_max": float(max(state.batch_rows, default=0)),
                   "batch_rows_min": float(min(state.batch_rows, default=0))}
        return EngineResult(rid, latents, trajectory, request.policy_version,
                            StopReason.FINISHED, metrics)

    def _fail(self, state: RequestState, exc: Exception) -> None:
        with self._cv:
            if state in self._running:
                self._running.remove(state)
        if not isinstance(exc, RolloutError):
            exc = ReplicaFailedError(f"engine step failed: {type(exc).__name__}: {exc}",
                                     request_id=state.request_id)
        if not state.future.done():
            state.future.set_exception(exc)

    def _drop_cancelled(self, cancel: set[str]) -> None:
        for state in list(self._running):
            if state.request_id in cancel:
                self._fail(state, RequestCancelledError(
                    "request cancelled", field="request_id", actual=state.request_id,
                    request_id=state.request_id))
            elif state.future.cancelled():           # the awaiting caller went away
                with self._cv:
                    self._running.remove(state)

    def _shutdown_pending(self) -> None:
        with self._cv:
            pending = [f for _, f, _ in self._intake] + [s.future for s in self._running]
            self._intake, self._running = [], []
        for future in pending:
            if not future.done():
                future.set_exception(ReplicaFailedError("engine shut down before the request "
                                                        "finished"))
