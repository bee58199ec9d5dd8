"""The embedded torch diffusion engine: a step-wise batching loop over a persistent batch.

Loop (vLLM v1 shape): admit -> schedule -> execute -> update.
  admit     a request is prepared in the admission thread, outside the engine lock and off the
            caller's event loop: condition media encoded, its sigma table and model times, its
            initial noise and the noise of every stochastic step (per-row seeds, drawn once);
            the loop then adds its rows to the persistent batch of its BatchKey between steps
  schedule  pick compatible requests (same state shape, CFG on/off, LoRA version, condition
            shape) up to max_batch_rows rows (engine_state.schedule, pure); each row keeps its
            own sigma table, step, window, guidance scale and seeds
  execute   the model runner: one forward for the picked rows, read from the persistent batch
            (CFG doubles them with the unconditional branch)
  update    each request's own sampler step (its pre-drawn noise), rows written back in place,
            forks re-lay a request's rows, finished / failed / cancelled requests retire and
            resolve their futures
What cannot share a forward: rows with and without CFG (predict_velocity doubles every row or
none; doubling the no-CFG rows to join would cost their compute twice), different policy
versions (a LoRA version is applied by forward hooks for the whole forward and a full-weight
version by swapping parameters; per-row LoRA would need each hooked activation's rows, which a
family that routes rows between experts by sigma, Wan 2.2, does not keep), different state or
condition shapes. Step counts, windows, samplers, noise levels and guidance scales share; rows
whose step is the same one-step kind at the same noise level also share one sampler transition.
One request never fails another: a request whose rows make the shared forward raise (found by
running each request of the failed forward alone) or whose velocity, sample or log-prob is not
finite (SampleRecorder.propose) fails alone, typed with its request id, and the forward is
redone without it before any request's step is recorded, so the others' outputs are exactly
those of a run it never joined. What float32 cannot carry (a noise level whose steps' std
squares to 0) is refused at admission, before any work.
Tree / branch rollouts: a request with `forks` splits every row at each fork's step into
children sharing the row's state and that step's forward, each child with its own noise from
its own seed; the result carries the tree (RolloutTree) and each leaf's whole trajectory.
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
from contract import (InvalidRequestError, LimitExceededError, MediaArtifact,
                      OutputContractError, PolicyVersionError, QueueFullError,
                      ReplicaFailedError, RequestCancelledError, RolloutError, SamplerKind,
                      SamplingSpec, StopReason, collect_artifacts)
from diffusion.conventions import model_time
from diffusion.noise import initial_noise, row_noise
from diffusion.samplers import DETERMINISTIC, check_noise_representable
from diffusion.step import FrozenLatents, Guidance, doubles_rows, predict_velocity
from diffusion.windows import uses_sde
from rollout.config import EngineLimits
from rollout.engine_api import EngineRequest, EngineResult, RolloutTree, build_tree
from rollout.engine_state import BatchKey, PersistentBatch, RequestState, schedule
from rollout.recorder import ProposedStep, RowFork, SampleRecorder, propose_stacked
from rollout.full_weights import PolicySlots
from rollout.lora import LoRASlotGroup


class EmbeddedEngine:
    """In-process engine over one family's transformer(s) (the training form, served as is)
    with versioned LoRA slots on each.

    models: component -> transformer module (e.g. {"transformer": ...}, two for Wan 2.2);
    media_modules: the components that encode condition media (a VAE), empty if none.
    """

    supports_forks = True                 # tree / branch rollouts (EngineRequest.forks)

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
        # a request moves intake -> preparing (admission thread) -> ready -> running (loop)
        self._intake: list[tuple[EngineRequest, concurrent.futures.Future, float]] = []
        self._preparing: list[tuple[EngineRequest, concurrent.futures.Future, float]] = []
        self._ready: list[RequestState] = []
        self._running: list[RequestState] = []
        self._batches: dict[BatchKey, PersistentBatch] = {}      # loop thread only
        self._cancel: set[str] = set()
        self._order = itertools.count()
        self._tick = 0
        self._paused = False
        self._stopped = False
        self._admission = threading.Thread(target=self._admission_loop,
                                           name=f"engine-admit-{family.name}", daemon=True)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{family.name}",
                                        daemon=True)
        self._admission.start()
        self._thread.start()

    # ---- public API (DiffusionEngine) -----------------------------------------------------
    async def generate(self, request: EngineRequest) -> EngineResult:
        return await asyncio.wrap_future(self.submit(request))

    def submit(self, request: EngineRequest) -> concurrent.futures.Future:
        """Queue a request; returns a future. Full queue -> QueueFullError at once. Holds the
        engine lock only to queue it: its preparation runs in the admission thread."""
        rid = request.request.request_id
        rows = request.request.sampling.samples_per_prompt
        if rows > self.limits.max_batch_rows:
            raise LimitExceededError("a request's rows must fit one forward", field="sampling.seeds",
                                     expected=f"<= {self.limits.max_batch_rows}", actual=rows,
                                     request_id=rid)
        check_forks(request, self.limits.max_batch_rows)
        self.slots.check(request.policy_version, rid)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                raise ReplicaFailedError("engine is shut down", request_id=rid)
            pending = self._pending_count()
            if pending >= self.limits.max_queue_requests:
                raise QueueFullError("engine queue is full", field="queue",
                                     expected=f"< {self.limits.max_queue_requests} pending",
                                     actual=pending, request_id=rid)
            if rid in self._pending_ids():
                raise InvalidRequestError("request id is already in flight", field="request_id",
                                          actual=rid, request_id=rid)
            self._intake.append((request, future, time.perf_counter()))
            self._cv.notify_all()
        return future

    def cancel(self, request_id: str) -> bool:
        """Fail the request's future with RequestCancelledError before its next step."""
        with self._cv:
            known = request_id in self._pending_ids()
            if known:
                self._cancel.add(request_id)
                self._cv.notify_all()
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
        """Pause stepping between steps (requests stay queued and are still prepared);
        `wake_up` resumes."""
        with self._cv:
            self._paused = True

    async def wake_up(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join)
        await loop.run_in_executor(None, self._admission.join)

    def _pending_count(self) -> int:
        return len(self._intake) + len(self._preparing) + len(self._ready) + len(self._running)

    def _pending_ids(self) -> set[str]:
        queued = self._intake + self._preparing
        return {r.request.request_id for r, _, _ in queued} | \
            {s.request_id for s in self._ready + self._running}

    def _pinned(self) -> frozenset[str]:
        with self._cv:
            return frozenset({s.request.policy_version for s in self._running + self._ready} |
                             {r.policy_version for r, _, _ in self._intake + self._preparing})

    # ---- admission (its own thread) ---------------------------------------------------------
    def _admission_loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopped and not self._intake:
                        self._cv.wait()
                    if self._stopped:
                        return
                    item = self._intake.pop(0)
                    self._preparing.append(item)
                request, future, enqueued = item
                state, error = None, None
                if not future.done():                    # the caller gave up before admission
                    try:                                 # outside the lock: submit never waits
                        state = self._new_state(request, future, enqueued)
                    except Exception as exc:  # noqa: BLE001 - bad input fails this request only
                        error = exc
                with self._cv:
                    self._preparing.remove(item)
                    if self._stopped and state is not None:
                        state, error = None, ReplicaFailedError(
                            "engine shut down before the request finished",
                            request_id=request.request.request_id)
                    if state is not None:
                        self._ready.append(state)
                    self._cv.notify_all()
                if error is not None and not future.done():
                    future.set_exception(error)

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
        if request.cond.rows != 1:
            raise InvalidRequestError("the engine takes a one-prompt condition", field="cond",
                                      expected=1, actual=request.cond.rows, request_id=rid)
        cond = request.cond.to(self.device)
        negative = request.negative.to(self.device) if guided else None
        if negative is not None and negative.batch_key() != cond.batch_key():
            raise InvalidRequestError("conditional and unconditional prompts must have the same "
                                      "shapes", field="negative", expected=cond.batch_key(),
                                      actual=negative.batch_key(), request_id=rid)
        inputs = {k: v.to(self.device) for k, v in media.inputs.items()}
        if request.forks and any(v.shape[0] != 1 for v in inputs.values()):
            raise InvalidRequestError("a tree rollout takes media inputs shared by its rows",
                                      field="forks", expected="media inputs of one row",
                                      actual={k: v.shape[0] for k, v in inputs.items()},
                                      request_id=rid)
        key = BatchKey(shape, guided, request.policy_version, cond.batch_key(),
                       media.batch_key())
        tree = build_tree(sampling.seeds, request.forks) if request.forks else None
        forks = {}
        if tree is not None:
            for fork in request.forks:
                before, after = tree.alive_at(fork.step - 1) if fork.step else \
                    tuple(range(rows)), tree.alive_at(fork.step)
                index = torch.tensor([before.index(tree.parents[n]) for n in after],
                                     dtype=torch.long, device=self.device)
                forks[fork.step] = RowFork(index, tuple(tree.seeds[n] for n in after))
        noise = step_noise(sampling, sigmas.shape[0] - 1, shape, tree)          # host memory
        recorder = SampleRecorder(sampling, sigmas.to(self.device), frozen, rid, noise)
        return RequestState(request, future, key, recorder, times.to(self.device), x, cond,
                            negative, inputs, enqueued, next(self._order), forks, tree)

    # ---- loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():   # no autograd bookkeeping (version counters) on the hot path
            self._run_loop()
        self._shutdown_pending()

    def _run_loop(self) -> None:
        while True:
            with self._cv:
                # idle: wait for everything submitted to be prepared, so requests submitted
                # together start together; busy: prepared requests join at the next step
                while not self._stopped and (
                        self._paused or not (self._ready or self._running) or
                        (not self._running and (self._intake or self._preparing))):
                    self._cv.wait()
                if self._stopped:
                    break
                ready, self._ready = self._ready, []
                self._running.extend(ready)
                cancel, self._cancel = self._cancel, set()
            for state in ready:
                self._join(state)
            self._drop_cancelled(cancel)
            batch = schedule(list(self._batches.values()), self.limits.max_batch_rows)
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

    def _join(self, state: RequestState) -> None:
        """Admit a prepared request's rows into the persistent batch of its key."""
        batch = self._batches.get(state.key)
        if batch is None:
            batch = self._batches[state.key] = PersistentBatch(state.key)
        try:
            batch.add(state)
        except Exception as exc:  # noqa: BLE001 - its rows do not fit the batch: it fails alone
            if state in batch.states:
                batch.remove(state)
            self._fail(state, exc)

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
            steps = propose_stacked([s.recorder for s in batch], [s.rows for s in batch],
                                    x, v_all, [s.forks.get(s.step) for s in batch])
            for state, step in zip(batch, steps):            # each request's own step
                if isinstance(step, Exception):              # this request's step only
                    self._fail(state, _step_error(step, state.request_id))
                    failed.append(state)
                else:
                    proposed[id(state)] = step
            if failed:                   # redo the forward without them: nothing recorded yet
                batch = [s for s in batch if s not in failed]
                continue
            self._update(batch, proposed, x.shape[0], now)
            return

    def _forward(self, batch: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model runner: (x, guided velocity) of every row of the batch, (R, *S) each,
        fp32, from the persistent batch's tensors."""
        head = batch[0]
        rows = self._batches[head.key].inputs(batch)
        guidance = Guidance.of(self.family.spec.guidance, rows.scales, rows.negative)
        with self.slots.active(head.key.policy_version):
            v_all = predict_velocity(self.family.denoiser, self.models, rows.x, rows.sigma,
                                     rows.cond, guidance, rows.inputs)           # (R, *S) fp32
        return rows.x, v_all

    def _update(self, batch: list[RequestState], proposed: dict[int, ProposedStep],
                rows: int, now: float) -> None:
        """Record every request's step and write its rows back into the persistent batch."""
        relaid = False
        persistent = self._batches[batch[0].key]
        for state in batch:
            step = proposed[id(state)]
            x_next = state.recorder.commit(step)
            if step.fork is not None:                # more rows from here on
                state.x = x_next
                relaid = True
            else:
                persistent.write(state, x_next)
            state.batch_rows.append(rows)
            state.last_tick = self._tick
            if state.started_at is None:
                state.started_at = now
        if relaid:
            persistent.rows_changed()

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
    def _retire(self, state: RequestState) -> bool:
        """Take the request out of the running set and its persistent batch (loop thread)."""
        with self._cv:
            if state not in self._running:
                return False
            self._running.remove(state)
        batch = self._batches.get(state.key)
        if batch is not None and state in batch.states:
            batch.remove(state)
            if not batch:
                del self._batches[state.key]
        state.x = state.x.clone()                    # its own rows, not a view of the batch
        return True

    def _finish(self, state: RequestState) -> None:
        self._retire(state)
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
                            StopReason.FINISHED, metrics, state.tree)

    def _fail(self, state: RequestState, exc: Exception) -> None:
        self._retire(state)
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
                self._retire(state)
        if cancel:                                   # cancelled while still being prepared
            with self._cv:
                self._cancel |= cancel - {s.request_id for s in self._running}
                self._cancel &= self._pending_ids()

    def _shutdown_pending(self) -> None:
        with self._cv:
            pending = [f for _, f, _ in self._intake + self._preparing] + \
                [s.future for s in self._ready + self._running]
            self._intake, self._ready, self._running = [], [], []
        self._batches = {}
        for future in pending:
            if not future.done():
                future.set_exception(ReplicaFailedError("engine shut down before the request "
                                                        "finished"))


def check_forks(request: EngineRequest, max_rows: int) -> None:
    """Refuse, before any work, forks that are out of order, outside the schedule, fork into
    identical children (no stochastic step from the fork on) or outgrow one forward."""
    if not request.forks:
        return
    sampling, rid = request.request.sampling, request.request.request_id
    rows, last = sampling.samples_per_prompt, -1
    for i, fork in enumerate(request.forks):
        if not last < fork.step < sampling.num_steps:
            raise InvalidRequestError("forks are at increasing steps inside the schedule",
                                      field=f"forks[{i}].step",
                                      expected=f"in ({last}, {sampling.num_steps})",
                                      actual=fork.step, request_id=rid)
        if fork.children < 2:
            raise InvalidRequestError("a fork has at least two children",
                                      field=f"forks[{i}].children", expected=">= 2",
                                      actual=fork.children, request_id=rid)
        if not any(_stochastic(sampling, j) for j in range(fork.step, sampling.num_steps)):
            raise InvalidRequestError("children of a fork differ only through stochastic steps "
                                      "after it", field=f"forks[{i}].step",
                                      expected=f"< {sampling.window[1]} (the SDE window's end)",
                                      actual=fork.step, request_id=rid)
        rows, last = rows * fork.children, fork.step
        if rows > max_rows:
            raise LimitExceededError("a forked request's rows must fit one forward",
                                     field=f"forks[{i}].children", expected=f"<= {max_rows} rows",
                                     actual=rows, request_id=rid)


def _stochastic(sampling: SamplingSpec, step: int) -> bool:
    return sampling.sampler not in DETERMINISTIC and uses_sde(step, sampling.window)


def step_noise(sampling: SamplingSpec, num_steps: int, shape: tuple[int, ...],
               tree: RolloutTree | None) -> dict[int, torch.Tensor]:
    """The noise of every stochastic step of a request, (rows at the step, *S) fp32 each on the
    host (rows x window x state: moved to the device at its step), drawn once from the seeds of
    the rows (a fork's children: their own seeds) alive at that step."""
    out = {}
    for j in range(num_steps):
        if _stochastic(sampling, j):
            seeds = sampling.seeds if tree is None else \
                tuple(tree.seeds[n] for n in tree.alive_at(j))
            out[j] = row_noise(seeds, j, shape)
    return out


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
