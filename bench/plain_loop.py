"""The plain denoising loop a user would write instead of the engine, on any device.

`plain_loop(family, models, requests, device)` stacks the rows of `requests` into one batch and
runs `diffusion.step.denoise_step` over the schedule -- a diffusers pipeline call's loop (one
forward per step for the whole batch, CFG rows doubled as the pipeline doubles them, the same
per-row seeded noise as the engine). One request per call is the diffusers-pipeline baseline;
all requests in one call is flow_grpo's static batch. The requests share steps, sampler and
guidance scale.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from adapters.family import ModelFamily
from contract import Condition, SamplerKind
from diffusion.noise import initial_noise, row_noise
from diffusion.step import Guidance, denoise_step, doubles_rows
from diffusion.windows import uses_sde
from rollout.engine_api import EngineRequest


@torch.inference_mode()
def plain_loop(family: ModelFamily, models: Mapping[str, torch.nn.Module],
               requests: Sequence[EngineRequest], device: str | torch.device = "cpu"
               ) -> torch.Tensor:
    """The final states (R, *S) fp32 of every row of `requests`, on `device`."""
    first = requests[0].request.sampling
    shape = family.codec.state_shape(first)
    seeds = [r.request.sampling.seeds for r in requests]
    x = torch.cat([initial_noise(s, shape) for s in seeds]).to(device, torch.float32)
    cond = Condition.cat([r.cond.expand_rows(len(s)) for r, s in zip(requests, seeds)]).to(device)
    rows = x.shape[0]
    uncond = None
    if doubles_rows(family.spec.guidance, first.guidance_scale):
        uncond = Condition.cat([r.negative.expand_rows(len(s))
                                for r, s in zip(requests, seeds)]).to(device)
    guidance = Guidance.of(family.spec.guidance, [first.guidance_scale] * rows, uncond)
    sigmas = family.sigmas(first).to(device)
    for j in range(first.num_steps):
        kind = first.sampler if uses_sde(j, first.window) else SamplerKind.ODE
        noise = None
        if kind is not SamplerKind.ODE:
            noise = torch.cat([row_noise(s, j, shape) for s in seeds]).to(device, torch.float32)
        x = denoise_step(family.denoiser, models, x, sigmas[j].expand(rows),
                         sigmas[j + 1].expand(rows), cond, guidance, kind, first.noise_level,
                         noise).prev_sample
    return x
