"""The learner's random draws, one seeded stream per row: a row's training noise, its NFT
timesteps and its DPO noise level are functions of (the step's noise seed, the row's rollout
seed, what is drawn, the draw index) only -- never of the rows it shares a micro-batch, a shard
or a worker with, so 1 worker and N workers, whole batches and micro-batches train on the same
numbers. Streams use diffusion/noise.py's SplitMix64 seeding (NoiseStream.TRAIN).

Gaussian noise is drawn on the learner's device by a generator of that device (no host copy);
the values are a function of the seeds and the device type (CPU and CUDA generators differ).
"""
from __future__ import annotations

from enum import IntEnum
from typing import Sequence

import torch

from contract import InvalidRequestError
from diffusion.noise import NoiseStream, row_seed
from trainer.algorithms import TimestepOrder, nft_timestep_indices, sample_pair_sigmas


class Draw(IntEnum):
    """What a row's stream is drawn for (a sub-stream each)."""

    NFT_TIMESTEPS = 0      # the schedule steps a row is trained at (all draws at once)
    NFT_NOISE = 1          # eps of training draw k
    DPO_SIGMA = 2          # the pair's noise level of draw k
    DPO_NOISE = 3          # the pair's eps of draw k
    AWM_TIMESTEPS = 4      # the schedule steps a row's AWM draws are at (all draws at once)
    AWM_NOISE = 5          # eps of AWM draw k


def _seed(noise_seed: int, row: int, draw: Draw, index: int) -> int:
    return row_seed(row_seed(noise_seed, NoiseStream.TRAIN, row), int(draw), index)


def _rows(row_seeds: Sequence[int]) -> tuple[int, ...]:
    rows = tuple(row_seeds)
    if not rows:
        raise InvalidRequestError("training draws need each row's rollout seed", field="seeds",
                                  expected="one seed per row", actual=[])
    return rows


def row_generator(noise_seed: int, row: int, draw: Draw, index: int,
                  device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_seed(noise_seed, row, draw, index))


def row_randn(noise_seed: int, row_seeds: Sequence[int], draw: Draw, index: int,
              shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, *shape) fp32 standard normal on `device`, row b from its own stream."""
    return torch.stack([torch.randn(tuple(shape), generator=row_generator(
        noise_seed, row, draw, index, device), device=device, dtype=torch.float32)
        for row in _rows(row_seeds)])


def row_timesteps(noise_seed: int, row_seeds: Sequence[int], num_steps: int, draws: int,
                  order: TimestepOrder, stream: Draw = Draw.NFT_TIMESTEPS) -> torch.Tensor:
    """(draws, B) int64 indices into the rollout's steps, row b's column from its stream."""
    return torch.cat([nft_timestep_indices(1, num_steps, draws, order, row_generator(
        noise_seed, row, stream, 0)) for row in _rows(row_seeds)], dim=1)


def pair_sigmas(noise_seed: int, row_seeds: Sequence[int], index: int,
                shift: float) -> torch.Tensor:
    """(P,) fp32 DPO noise levels of draw `index`, pair p from its winner's stream."""
    return torch.cat([sample_pair_sigmas(1, shift=shift, generator=row_generator(
        noise_seed, row, Draw.DPO_SIGMA, index)) for row in _rows(row_seeds)])
