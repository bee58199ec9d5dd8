"""One request's sampler bookkeeping, shared by every engine (embedded, vLLM-Omni pipeline).

The model forward is batched by the engine; everything after it is per request and lives here:
which sampler kind the step uses (a deterministic kind at every step, a stochastic one inside its
SDE window and ODE outside), the per-row seeded noise, the transition (frozen condition entries,
a multistep solver's history) and the fp32 trajectory of the window with its log-probs.

    recorder = SampleRecorder(sampling, sigmas, frozen)
    while not recorder.done:
        sigma, _ = recorder.sigmas_now(rows)
        v = predict_velocity(...)            # the engine's (batched) forward
        x = recorder.advance(x, v)
    trajectory = recorder.trajectory(model_times, policy_version)

Nothing non-finite leaves: `propose` checks the velocity it is given and the sample and log-prob
it computes, row by row, and raises NonFiniteOutputError for this request without changing its
state; `commit` then records the step (`advance` = both). An engine that batches requests
proposes every request's step before committing any, so a request that fails its step can be
taken out and the others' forward redone without it; `propose_stacked` computes the steps of
many requests' stacked rows in one transition per (kind, noise level) where they can share it.

An engine may hand the recorder every stochastic step's noise at construction (`noise`, drawn
once per request ahead of its first step) and fork its rows: a step proposed with `fork` runs
the rows picked by its index (children sharing their parent's state and forward) and its commit
re-indexes the recorded prefix the same way, so each child's trajectory is its whole path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from contract import NonFiniteOutputError, SamplerKind, SamplingSpec, Trajectory
from diffusion.noise import row_noise
from diffusion.samplers import DETERMINISTIC, MULTISTEP, SolverHistory, StepOutput
from diffusion.step import FrozenLatents, transition
from diffusion.windows import check_flash_table, uses_sde


@dataclass(frozen=True)
class ProposedStep:
    """One step computed but not yet recorded (`SampleRecorder.propose`)."""

    step: int
    x: torch.Tensor                 # (B, *S) the state the step started from
    out: StepOutput
    fork: "RowFork | None" = None   # the rows were forked at this step


@dataclass(frozen=True)
class RowFork:
    """Rows forked at a step: new row i continues old row index[i] with seed seeds[i]."""

    index: torch.Tensor             # (B',) long, into the rows before the fork
    seeds: tuple[int, ...]          # (B',)


def check_finite(value: torch.Tensor, field: str, request_id: str | None) -> None:
    """NonFiniteOutputError naming the field and the rows holding NaN / Inf. value: (B, ...)."""
    finite = torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1) if value.ndim else \
        torch.isfinite(value).reshape(1)
    if not bool(finite.all()):
        rows = (~finite).nonzero().flatten().tolist()
        raise NonFiniteOutputError("a stage produced NaN or Inf", field=field,
                                   expected="finite", actual=f"rows {rows[:8]}",
                                   request_id=request_id)


class SampleRecorder:
    def __init__(self, sampling: SamplingSpec, sigmas: torch.Tensor,
                 frozen: FrozenLatents | None = None, request_id: str | None = None,
                 noise: Mapping[int, torch.Tensor] | None = None):
        """noise: step -> (rows at that step, *S) fp32 noise of every stochastic step, drawn
        ahead (held where the caller put it, moved to x's device at its step); None = drawn
        per step from the rows' seeds."""
        self.request_id = request_id
        self.sampling = sampling
        self.seeds = tuple(sampling.seeds)         # per current row
        self.noise = noise
        self.sigmas = sigmas                       # (N+1,) fp32 on the engine's device
        if sampling.flash_compress is not None:    # the table must be MixGRPO-Flash's
            check_flash_table(sampling, int(sigmas.shape[0]) - 1, request_id)
        self.frozen = frozen
        self.step = 0
        self.history: SolverHistory | None = None
        self.latents: list[torch.Tensor] = []      # each (B, *S) fp32
        self.log_probs: list[torch.Tensor] = []    # each (B,) fp32

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1

    @property
    def window(self) -> tuple[int, int]:
        return self.sampling.window

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    def kind(self) -> SamplerKind:
        """The sampler of the current step: outside the SDE window ODE, or after it
        DPM-Solver++(2M) under MixGRPO-Flash (`sampling.flash_compress`)."""
        sampler = self.sampling.sampler
        if sampler in DETERMINISTIC:
            return sampler
        if uses_sde(self.step, self.window):
            return sampler
        if self.sampling.flash_compress is not None and self.step >= self.window[1]:
            return SamplerKind.DPM2
        return SamplerKind.ODE

    def step_noise(self, rows: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """(rows, *S) fp32 noise of the current (stochastic) step."""
        if self.noise is not None:
            return self.noise[self.step].to(device)
        return row_noise(self.seeds, self.step, shape).to(device, torch.float32)

    def sigmas_now(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma, sigma_next) of the current step, (rows,) each."""
        return (self.sigmas[self.step].expand(rows), self.sigmas[self.step + 1].expand(rows))

    def advance(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One sampler step of this request's rows from the guided velocity v; records the
        window. x, v: (B, *S) fp32. Returns x at the next sigma."""
        return self.commit(self.propose(x, v))

    def propose(self, x: torch.Tensor, v: torch.Tensor,
                fork: RowFork | None = None) -> ProposedStep:
        """The current step from the guided velocity v, computed and checked finite (velocity,
        sample, log-prob) but not recorded. x, v: (B, *S) fp32, the rows before a fork (the
        step runs the forked rows x[fork.index])."""
        j, kind = self.step, self.kind()
        check_finite(v, f"velocity[step {j}]", self.request_id)
        frozen, history, seeds = self.frozen, self.history, self.seeds
        if fork is not None:
            x, v = x[fork.index], v[fork.index]
            frozen = None if frozen is None else frozen.index_select(fork.index)
            history = None if history is None else SolverHistory(history.x0[fork.index],
                                                                 history.sigma[fork.index])
            seeds = fork.seeds
        sigma, sigma_next = self.sigmas_now(x.shape[0])
        noise = None
        if kind not in DETERMINISTIC:
            noise = self.noise[j].to(x.device) if self.noise is not None else \
                row_noise(seeds, j, tuple(x.shape[1:])).to(x.device, torch.float32)
        out = transition(kind, x, v, sigma, sigma_next, self.sampling.noise_level, noise,
                         frozen=frozen, history=history if kind in MULTISTEP else None)
        if out.history is None and self.sampling.flash_compress is not None:
            # MixGRPO-Flash: every step's data prediction feeds the solver after the window
            out = dataclasses.replace(out, history=SolverHistory(
                x - sigma.reshape(-1, *([1] * (x.ndim - 1))) * v, sigma))
        check_finite(out.prev_sample, f"latents[step {j}]", self.request_id)
        if out.log_prob is not None:
            check_finite(out.log_prob, f"log_probs[step {j}]", self.request_id)
        return ProposedStep(j, x, out, fork)

    def commit(self, proposed: ProposedStep) -> torch.Tensor:
        """Record a proposed step (the window's latents and log-probs); returns x at the next
        sigma."""
        j, out = proposed.step, proposed.out
        if j != self.step:
            raise RuntimeError(f"step {j} was proposed, the recorder is at step {self.step}")
        if proposed.fork is not None:                # the recorded prefix, per child
            index = proposed.fork.index
            self.latents = [t[index.to(t.device)] for t in self.latents]
            self.log_probs = [t[index.to(t.device)] for t in self.log_probs]
            if self.frozen is not None:
                self.frozen = self.frozen.index_select(index)
            self.seeds = proposed.fork.seeds
        start, end = self.window
        if j == start:
            self.latents.append(proposed.x.float().clone())
        self.history = out.history
        if start <= j < end:
            self.log_probs.append(out.log_prob.float())
            self.latents.append(out.prev_sample.float().clone())
        self.step = j + 1
        return out.prev_sample

    def trajectory(self, model_times: torch.Tensor, policy_version: str) -> Trajectory:
        rows = self.latents[0].shape[0]
        log_probs = torch.stack(self.log_probs, dim=1) if self.log_probs else \
            torch.zeros(rows, 0)                                                    # (B, W)
        s = self.sampling
        return Trajectory(
            latents=torch.stack(self.latents, dim=1).cpu(),                         # (B, W+1, *S)
            sigmas=self.sigmas.cpu(), model_timesteps=model_times.cpu(),
            log_probs=log_probs.cpu(), window=self.window, sampler=s.sampler,
            noise_level=s.noise_level, guidance_scale=s.guidance_scale, seeds=self.seeds,
            policy_version=policy_version,
            frozen_mask=None if self.frozen is None else self.frozen.mask[:1].cpu())


def _shares_transition(recorder: SampleRecorder, fork: RowFork | None) -> bool:
    """One-step kinds without held entries or a fork run in a transition shared by requests."""
    return fork is None and recorder.frozen is None and recorder.history is None and \
        recorder.sampling.sampler not in MULTISTEP and recorder.sampling.flash_compress is None


def propose_stacked(recorders: Sequence[SampleRecorder], rows: Sequence[int], x: torch.Tensor,
                    v: torch.Tensor, forks: Sequence[RowFork | None]
                    ) -> list[ProposedStep | Exception]:
    """Each request's `propose` on its rows of the stacked x, v ((R, *S), rows[i] rows of
    request i, in order; a fork's rows before it): requests whose step is the same one-step kind at the same noise level share one
    transition (per-row sigmas and noise; the same values as their own steps). Returns per
    request its ProposedStep, or the exception its own propose raises (NaN / Inf rows are
    found on the shared step, then the request's own propose names them)."""
    out: list[ProposedStep | Exception | None] = [None] * len(recorders)
    slices, offset = [], 0
    for n in rows:
        slices.append(slice(offset, offset + n))
        offset += n
    groups: dict[tuple, list[int]] = {}
    for i, (recorder, fork) in enumerate(zip(recorders, forks)):
        if _shares_transition(recorder, fork):
            groups.setdefault((recorder.kind(), recorder.sampling.noise_level), []).append(i)
    alone = [i for i in range(len(recorders)) if not any(i in g for g in groups.values())]
    for (kind, noise_level), members in groups.items():
        if len(members) == 1:
            alone.extend(members)
            continue
        parts = [slices[i] for i in members]
        contiguous = all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        pick = (lambda t: t[parts[0].start:parts[-1].stop]) if contiguous else \
            (lambda t: torch.cat([t[sl] for sl in parts]))
        xg, vg = pick(x), pick(v)
        sigma = torch.cat([recorders[i].sigmas_now(rows[i])[0] for i in members])
        sigma_next = torch.cat([recorders[i].sigmas_now(rows[i])[1] for i in members])
        noise = None
        if kind not in DETERMINISTIC:
            noise = torch.cat([recorders[i].step_noise(rows[i], tuple(x.shape[1:]), x.device)
                               for i in members])
        step = transition(kind, xg, vg, sigma, sigma_next, noise_level, noise)
        finite = _finite_rows(vg) & _finite_rows(step.prev_sample)
        if step.log_prob is not None:
            finite &= torch.isfinite(step.log_prob)
        start = 0
        for i, sl in zip(members, parts):
            n = rows[i]
            if not bool(finite[start:start + n].all()):      # its own propose names the rows
                alone.append(i)
            else:
                part = StepOutput(*(None if f is None else f[start:start + n] for f in (
                    step.prev_sample, step.log_prob, step.mean, step.std, step.sqrt_dt,
                    step.std_dev_t)))
                out[i] = ProposedStep(recorders[i].step, x[sl], part)
            start += n
    for i in alone:
        try:
            out[i] = recorders[i].propose(x[slices[i]], v[slices[i]], forks[i])
        except Exception as exc:  # noqa: BLE001 - the caller fails this request only
            out[i] = exc
    return out


def _finite_rows(value: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
