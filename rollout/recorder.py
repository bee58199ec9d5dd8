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
"""
from __future__ import annotations

import torch

from contract import SamplerKind, SamplingSpec, Trajectory
from diffusion.noise import row_noise
from diffusion.samplers import DETERMINISTIC, SolverHistory
from diffusion.step import FrozenLatents, transition
from diffusion.windows import uses_sde


class SampleRecorder:
    def __init__(self, sampling: SamplingSpec, sigmas: torch.Tensor,
                 frozen: FrozenLatents | None = None):
        self.sampling = sampling
        self.sigmas = sigmas                       # (N+1,) fp32 on the engine's device
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
        """The sampler of the current step."""
        sampler = self.sampling.sampler
        if sampler in DETERMINISTIC:
            return sampler
        return sampler if uses_sde(self.step, self.window) else SamplerKind.ODE

    def sigmas_now(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma, sigma_next) of the current step, (rows,) each."""
        return (self.sigmas[self.step].expand(rows), self.sigmas[self.step + 1].expand(rows))

    def advance(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One sampler step of this request's rows from the guided velocity v; records the
        window. x, v: (B, *S) fp32. Returns x at the next sigma."""
        j, kind = self.step, self.kind()
        start, end = self.window
        sigma, sigma_next = self.sigmas_now(x.shape[0])
        if j == start:
            self.latents.append(x.float().clone())
        noise = None
        if kind not in DETERMINISTIC:
            noise = row_noise(self.sampling.seeds, j, tuple(x.shape[1:])).to(x.device,
                                                                               torch.float32)
        out = transition(kind, x, v, sigma, sigma_next, self.sampling.noise_level, noise,
                         frozen=self.frozen, history=self.history)
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
            noise_level=s.noise_level, guidance_scale=s.guidance_scale, seeds=s.seeds,
            policy_version=policy_version,
            frozen_mask=None if self.frozen is None else self.frozen.mask[:1].cpu())
