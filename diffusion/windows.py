"""SDE windows (Flow-GRPO-Fast / MixGRPO): steps [start, end) are stochastic, the rest are ODE.

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
