"""Per-row seeded Gaussian noise that never depends on the batch a row runs in.

The noise for a row is a function of (seed, stream, step) only: each row gets its own CPU
torch.Generator seeded with

    row_seed(seed, stream, step) = h(h(h(seed) ^ stream) ^ step),   h = SplitMix64 finaliser

(Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators"), so a row yields the
same noise alone or in a batch of 8, on any device, and neighbouring seeds / steps give unrelated
streams. The initial noise x_1 and the per-step SDE noise use different streams, so a seed's
starting point never equals one of its step noises.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Sequence

import torch

from contract.errors import InvalidRequestError

_MASK64 = (1 << 64) - 1


class NoiseStream(IntEnum):
    INITIAL = 0   # x at sigma = 1
    STEP = 1      # the SDE / CPS noise of step `step_index`
    TRAIN = 2     # the trainer's draws for a row (trainer/train_noise.py), keyed by its seed


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_seed(seed: int, stream: NoiseStream, step: int) -> int:
    """The 64-bit generator seed of one row's noise at (stream, step)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ int(stream)) ^ step)


def _check_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    seeds = tuple(seeds)
    if len(seeds) == 0:
        raise InvalidRequestError("need one seed per row (got none)", field="seeds",
                                  expected="non-empty", actual=[])
    for i, s in enumerate(seeds):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _MASK64:
            raise InvalidRequestError("a seed must be an int in [0, 2**64)", field=f"seeds[{i}]",
                                      expected="int in [0, 2**64)", actual=s)
    return seeds


def _draw(seeds: Sequence[int], stream: NoiseStream, step: int, shape: Sequence[int],
          dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    seeds = _check_seeds(seeds)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidRequestError("step_index must be an int >= 0", field="step_index",
                                  expected=">= 0", actual=step)
    shape = tuple(int(d) for d in shape)
    out = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(row_seed(seed, stream, step))
        out.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return torch.stack(out).to(device=device, dtype=dtype)                    # (B, *shape)


def row_noise(seeds: Sequence[int], step_index: int, shape: Sequence[int],
              dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
    """(B, *shape) standard normal noise of step `step_index`, row b from seeds[b] alone."""
    return _draw(seeds, NoiseStream.STEP, step_index, shape, dtype, device)


def initial_noise(seeds: Sequence[int], shape: Sequence[int],
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """(B, *shape) starting point x at sigma = 1, row b from seeds[b] alone."""
    return _draw(seeds, NoiseStream.INITIAL, 0, shape, dtype, device)
