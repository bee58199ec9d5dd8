"""SDE windows (Flow-GRPO-Fast, MixGRPO): steps [start, end) are stochastic, the rest are ODE.

All rows of one prompt group must share the same window: per-row windows inflate the reward
spread within a group and collapse training (notes/rl_algorithms.md section 1.3 and 6 item 5).
So a window is drawn once per group, from a generator the caller seeds per group.
"""
from __future__ import annotations

import random

from contract.errors import InvalidRequestError


def _check_window(window: tuple[int, int], field: str = "window") -> tuple[int, int]:
    try:
        start, end = (int(w) for w in window)
    except (TypeError, ValueError):
        raise InvalidRequestError("a window is a pair (start, end)", field=field,
                                  expected="(start, end)", actual=window) from None
    if not 0 <= start <= end:
        raise InvalidRequestError("a window needs 0 <= start <= end", field=field,
                                  expected="0 <= start <= end", actual=(start, end))
    return start, end


def uses_sde(step_index: int, window: tuple[int, int]) -> bool:
    """Whether step `step_index` (0-based) is inside the half-open SDE window [start, end)."""
    start, end = _check_window(window)
    return start <= step_index < end


def sample_sde_window(num_steps: int, size: int, window_range: tuple[int, int],
                      rng: random.Random) -> tuple[int, int]:
    """Draw one window of `size` steps for one prompt group.

    start ~ Uniform{range0, ..., range1 - size} (both ends inclusive), end = start + size
    (the reference's `random.randint(range[0], range[1] - size)`, notes section 1.3).
    """
    if num_steps < 1:
        raise InvalidRequestError("num_steps must be >= 1", field="num_steps", expected=">= 1",
                                  actual=num_steps)
    if not 1 <= size <= num_steps:
        raise InvalidRequestError("window size must be in [1, num_steps]", field="size",
                                  expected=f"1..{num_steps}", actual=size)
    lo, hi = _check_window(window_range, "window_range")
    if hi > num_steps:
        raise InvalidRequestError("window_range must end within the schedule",
                                  field="window_range", expected=f"end <= {num_steps}",
                                  actual=(lo, hi))
    if hi - lo < size:
        raise InvalidRequestError("window_range is shorter than the window", field="window_range",
                                  expected=f"end - start >= {size}", actual=(lo, hi))
    start = rng.randint(lo, hi - size)
    return start, start + size


def sliding_sde_window(iteration: int, num_steps: int, size: int, shift_every: int,
                       stride: int | None = None, roll_back: bool = False) -> tuple[int, int]:
    """MixGRPO's sliding SDE window for optimizer step `iteration` (0-based): every prompt of
    the step shares it, ODE outside it.

    The window starts at step 0 and moves by `stride` (None = `size`, no overlap) every
    `shift_every` iterations; it covers [start, min(start + size, last)) with last = num_steps - 2,
    the bound MixGRPO's trainer gives its window (`max_timesteps`). Past `last` the start stays
    at `last` (the reference then trains nothing: refused here) or, with `roll_back`, goes back
    to 0. Closed form of MixGRPO's progressive GRPOTrainingStates after `iteration` updates.

    Raises:
        InvalidRequestError: a bad argument, or an empty window at this iteration (field
            "iteration").
    """
    if num_steps < 3:
        raise InvalidRequestError("a sliding window needs num_steps >= 3 (it ends before the "
                                  "last two steps)", field="num_steps", expected=">= 3",
                                  actual=num_steps)
    last = num_steps - 2
    stride = size if stride is None else stride
    for field, value in (("size", size), ("stride", stride)):
        if not 1 <= value <= last:
            raise InvalidRequestError(f"{field} must be in 1..num_steps - 2", field=field,
                                      expected=f"1..{last}", actual=value)
    if shift_every < 1:
        raise InvalidRequestError("shift_every must be >= 1", field="shift_every",
                                  expected=">= 1", actual=shift_every)
    if iteration < 0:
        raise InvalidRequestError("iteration must be >= 0", field="iteration", expected=">= 0",
                                  actual=iteration)
    moves = iteration // shift_every
    if roll_back:
        start = (moves % (last // stride + 1)) * stride     # positions 0, stride, ... <= last
    else:
        start = min(moves * stride, last)
    end = min(start + size, last)
    if end <= start:
        raise InvalidRequestError("the sliding window has reached the end of the schedule (no "
                                  f"step left before num_steps - 2 = {last})", field="iteration",
                                  expected=f"a window with start < {last}", actual=iteration)
    return start, end


def sliding_window_exhausted(num_steps: int, size: int, shift_every: int, stride: int | None,
                             roll_back: bool) -> int | None:
    """The first iteration whose sliding window is empty (`sliding_sde_window` refuses it);
    None if every iteration has a window."""
    last = num_steps - 2
    stride = size if stride is None else stride
    if roll_back:
        return (last // stride) * shift_every if last % stride == 0 else None
    return -(-last // stride) * shift_every          # ceil(last / stride) moves
