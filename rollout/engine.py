"""The embedded torch diffusion engine: a step-wise batching loop in its own thread.

Loop (vLLM v1 shape): admit -> schedule -> execute -> update.
  admit     new requests join the running set between denoising steps (initial noise per row seed)
  schedule  pick compatible requests (same adapter state shape, CFG on/off, LoRA version, condition
            shape) up to max_batch_rows rows; each keeps its own sigmas, window, seeds and step
  execute   one forward for all picked rows (CFG doubles them with the unconditional branch),
            then each request's own sampler step with its per-row seeded noise
  update    record the fp32 trajectory, finish / fail / cancel requests, resolve their futures
One request never fails another: a request whose rows make the shared forward raise (found by
running each request of the failed forward alone) or whose velocity, sample or log-prob is not
finite (SampleRecorder.propose) fails alone, typed with its request id, and the forward is
redone without it before any request's step is recorded, so the others' outputs are exactly
those of a run it never joined. What float32 cannot carry (a noise level whose steps' std
squares to 0) is refused at admission, before any work.
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

from adapters.family import ModelFamily
from adapters.lora_targets import LoRATargetMap
from contract import (Condition, InvalidRequestError, LimitExceededError, MediaArtifact,
                      OutputContractError, PolicyVersionError, QueueFullError,
                      ReplicaFailedError, RequestCancelledError, RolloutError, SamplerKind,
                      StopReason, collect_artifacts)
from diffusion.conventions import model_time
from diffusion.noise import initial_noise
from diffusion.samplers import check_noise_representable
from diffusion.step import FrozenLatents, Guidance, doubles_rows, predict_velocity
from rollout.config import EngineLimits
from rollout.engine_api import EngineRequest, EngineResult
from rollout.engine_state import BatchKey, RequestState, schedule
from rollout.recorder import ProposedStep, SampleRecorder
from rollout.full_weights import PolicySlots
from rollout.lora import LoRASlotGroup


class EmbeddedEngine:
    """In-process engine over one family's transformer(s) (the training form, served as is)
    with versioned LoRA slots on each.

    models: component -> transformer module (e.g. {"transformer": ...}, two for Wan 2.2);
    media_modules: the components that encode condition media (a VAE), empty if none.
    """

    def __init__(self, family: ModelFamily, models: Mapping[str, torch.nn.Module],
                 media_modules: Mapping[str, torch.nn.Module] | None = None,
                 limits: EngineLimits | None = None, device: str = "cpu",
                 lora_maps: Mapping[str, LoRATargetMap] | None = None):
        """lora_maps: where training-named LoRA tensors land per transformer; None = the
        identity over the family's targets (the training form is served as it is)."""
        self.family = family
        self.limits = limits or EngineLimits()
        self.device = torch.device(device)
        self.models = {name: m.to(self.device).eval() for name, m in models.items()}
        self.media_modules = dict(media_modules or {})
        maps = dict(lora_maps) if lora_maps is not None else \
            {name: LoRATargetMap.identity(family.spec.lora_targets[name]) for name in self.models}
        self.slots = PolicySlots(LoRASlotGroup(self.models, maps,
                                               self.limits.max_resident_lora_versions),
                                 self.models, self.limits.max_resident_full_versions)
        self._cv = threading.Condition()
        self._intake: list[tuple[EngineRequest, concurrent.futures.Future, float]] = []
        self._running: list[RequestState] = []
        self._cancel: set[str] = set()
        self._order = itertools.count()
        self._tick = 0
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{family.name}",
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

    def load_full(self, version: str, tensors: Mapping[str, torch.Tensor],
                  copy: bool = True, wait_s: float = 600.0) -> None:
        """Hold a full-weight version (rollout/full_weights.py). When every resident full
        version is in use, wait (up to wait_s) for their running requests to finish."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.slots.load_full(version, tensors, pinned=self._pinned(), copy=copy)
            except PolicyVersionError:
                if time.monotonic() > deadline or not set(self.slots.full.versions()) <= \
                        self._pinned():
                    raise
                time.sleep(0.02)

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
                for state in batch:       # not one request's: a retryable replica fault
                    self._fail(state, _step_error(exc, state.request_id)
                               if isinstance(exc, InvalidRequestError) else exc)
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
        rr, family = request.request, self.family
        sampling, rid = rr.sampling, rr.request_id
        guided = doubles_rows(family.spec.guidance, sampling.guidance_scale)
        if guided != (request.negative is not None):
            raise InvalidRequestError("the unconditional condition is given exactly when CFG "
                                      "doubles the rows", field="negative",
                                      expected="Condition" if guided else None,
                                      actual=None if request.negative is None else "Condition",
                                      request_id=rid)
        if sampling.sampler != SamplerKind.ODE and sampling.noise_level == 0 and \
                sampling.window[1] > sampling.window[0]:
            raise InvalidRequestError("a stochastic window needs noise_level > 0 (no log-prob "
                                      "exists at 0)", field="sampling.noise_level",
                                      expected="> 0", actual=0.0, request_id=rid)
        media = family.codec.encode_media(self.media_modules, sampling, dict(request.media))
        shape = tuple(media.state_shape or family.codec.state_shape(sampling))
        rows = sampling.samples_per_prompt
        sigmas = family.request_sigmas(sampling, media).to(torch.float32)
        check_noise_representable(sampling.sampler, sigmas, sampling.window,
                                  sampling.noise_level, request_id=rid)
        times = model_time(sigmas[:-1], family.denoiser.time_convention,
                           family.denoiser.model_time_scale)
        x = initial_noise(sampling.seeds, shape).to(self.device, torch.float32)     # (B, *S)
        frozen = None
        if media.frozen is not None:
            frozen = FrozenLatents(media.frozen.mask.expand(rows, *shape).to(self.device),
                                   media.frozen.values.expand(rows, *shape).to(self.device))
            x = frozen.apply(x)
        cond = request.cond.expand_rows(rows).to(self.device)
        negative = request.negative.expand_rows(rows).to(self.device) if guided else None
        if negative is not None and negative.batch_key() != cond.batch_key():
            raise InvalidRequestError("conditional and unconditional prompts must have the same "
                                      "shapes", field="negative", expected=cond.batch_key(),
                                      actual=negative.batch_key(), request_id=rid)
        inputs = {k: v.to(self.device).expand(rows, *v.shape[1:]) for k, v in media.inputs.items()}
        key = BatchKey(shape, guided, request.policy_version, cond.batch_key(),
                       media.batch_key())
        recorder = SampleRecorder(sampling, sigmas.to(self.device), frozen, rid)
        return RequestState(request, future, key, recorder, times.to(self.device), x, cond,
                            negative, inputs, enqueued, next(self._order))

    def _execute(self, batch: list[RequestState]) -> None:
        """One forward for every row of the batch, then each request's own sampler step. A
        request that fails its part is failed alone and the forward redone without it; steps
        are recorded only once every remaining request's step succeeded."""
        self._tick += 1
        now = time.perf_counter()
        while batch:
            try:
                x, v_all = self._forward(batch)
            except Exception as exc:  # noqa: BLE001 - find the request(s) it came from
                batch = self._without_culprits(batch, exc)
                continue
            proposed: dict[int, ProposedStep] = {}
            failed: list[RequestState] = []
            offset = 0
            for state in batch:
                sl = slice(offset, offset + state.rows)
                offset += state.rows
                try:                                         # its own sampler step
                    proposed[id(state)] = state.recorder.propose(x[sl], v_all[sl])
                except Exception as exc:  # noqa: BLE001 - this request's step only
                    self._fail(state, _step_error(exc, state.request_id))
                    failed.append(state)
            if failed:                   # redo the forward without them: nothing recorded yet
                batch = [s for s in batch if s not in failed]
                continue
            rows = x.shape[0]
            for state in batch:
                state.x = state.recorder.commit(proposed[id(state)])
                state.batch_rows.append(rows)
                state.last_tick = self._tick
                if state.started_at is None:
                    state.started_at = now
            return

    def _forward(self, batch: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, guided velocity) of every row of the batch: (R, *S) each, fp32."""
        head = batch[0]
        x = torch.cat([s.x for s in batch])                                        # (R, *S)
        sigma = torch.cat([s.recorder.sigmas_now(s.rows)[0] for s in batch])       # (R,)
        cond = Condition.cat([s.cond for s in batch])
        scales = torch.cat([torch.full((s.rows,), s.request.request.sampling.guidance_scale)
                            for s in batch])
        uncond = Condition.cat([s.negative for s in batch]) if head.key.guided else None
        media = {k: torch.cat([s.inputs[k] for s in batch]) for k in head.inputs}
        guidance = Guidance.of(self.family.spec.guidance, scales, uncond)
        with self.slots.active(head.key.policy_version):
            v_all = predict_velocity(self.family.denoiser, self.models, x, sigma, cond, guidance,
                                     media)                                        # (R, *S) fp32
        return x, v_all

    def _without_culprits(self, batch: list[RequestState],
                          exc: Exception) -> list[RequestState]:
        """The batch's forward raised `exc`: each request's rows are run alone, those that
        raise fail with their own error and the rest are returned (to run together again).
        When every request runs alone the fault is not one request's: `exc` is raised (the
        loop fails the batch)."""
        if len(batch) == 1:
            raise exc
        culprits = []
        for state in batch:
            try:
                self._forward([state])
            except Exception as own:  # noqa: BLE001 - its own rows raise
                self._fail(state, _step_error(own, state.request_id))
                culprits.append(state)
        if not culprits:
            raise exc
        return [s for s in batch if s not in culprits]

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
        io_spec = self.family.io_spec
        named = self.family.codec.split_state(state.x, sampling)
        produced = [MediaArtifact(io_spec[name], named[name].float().cpu())
                    for name in request.latent_artifacts if name in named]
        latents = collect_artifacts(io_spec, request.latent_artifacts, produced, rid)
        trajectory = state.recorder.trajectory(state.model_times, request.policy_version)
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


def _step_error(exc: Exception, request_id: str) -> Exception:
    """A request's own failure inside a step it was admitted to. Its input passed admission,
    so a contract error raised by the math, or any other exception, is the server's
    (OutputContractError, 500, not retried: the same rows fail the same way), never a 4xx
    blaming the client; typed errors of the server's kinds stay as they are."""
    if isinstance(exc, InvalidRequestError):
        return OutputContractError(f"the denoising step failed: {exc.message}",
                                   field=exc.field, expected=exc.expected, actual=exc.actual,
                                   request_id=request_id)
    if not isinstance(exc, RolloutError):
        return OutputContractError(f"the denoising step failed: {type(exc).__name__}: {exc}",
                                   field="step", request_id=request_id)
    return exc
