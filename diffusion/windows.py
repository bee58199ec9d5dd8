"""SDE windows (Flow-GRPO-Fast, MixGRPO): steps [start, end) are stochastic, the rest are ODE
(MixGRPO-Flash: DPM-Solver++(2M) on a shorter schedule after the window, `flash_schedule`).

All rows of one prompt group must share the same window: per-row windows inflate the reward
spread within a group and collapse training (Flow-GRPO-Fast draws one window per group).
So a window is drawn once per group, from a generator the caller seeds per group.
"""
from __future__ import annotations

import random

import torch

from contract.errors import InvalidRequestError
from contract.request import SamplingSpec


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
    (Flow-GRPO-Fast's `random.randint(range[0], range[1] - size)`).
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


def flash_post_points(num_steps: int, window_end: int, compress_ratio: float) -> int:
    """MixGRPO-Flash's point count after the SDE window, sigma_end included, 0 included:
    int(max((num_steps - window_end + 1) * compress_ratio, 1)) (`dpm_post_compress_ratio`).

    Raises:
        InvalidRequestError: a ratio outside (0, 1], a window ending at or past the schedule's
            end, or fewer than 2 points (the schedule would stop short of sigma 0; the
            reference then ends at sigma_end).
    """
    if not 0.0 < compress_ratio <= 1.0:
        raise InvalidRequestError("compress_ratio must be in (0, 1]", field="compress_ratio",
                                  expected="(0, 1]", actual=compress_ratio)
    if not 1 <= window_end < num_steps:
        raise InvalidRequestError("a higher-order solver after the SDE window needs the window "
                                  "to end before the last step", field="window_end",
                                  expected=f"1..{num_steps - 1}", actual=window_end)
    points = int(max((num_steps - window_end + 1) * compress_ratio, 1))
    if points < 2:
        raise InvalidRequestError(f"compress_ratio leaves {points} point after the window: the "
                                  "schedule would not reach sigma 0", field="compress_ratio",
                                  expected=f">= {2 / (num_steps - window_end + 1):.4g}",
                                  actual=compress_ratio)
    return points


def flash_schedule(sigmas: torch.Tensor, window_end: int, compress_ratio: float,
                   shift: float) -> torch.Tensor:
    """MixGRPO-Flash's schedule: sigmas[:window_end], then flash_post_points(...) points from
    sigmas[window_end] to 0, evenly spaced in the schedule's unshifted time t and shifted
    (sigma = s t / (1 + (s - 1) t)), as MixGRPO's run_sample_step rebuilds it for its
    DPM-Solver after the window. t at sigmas[window_end] is the shift's inverse there (MixGRPO
    reads it from linspace(1, 0, N + 1), the same for its shifted-linear tables); the first
    post point is sigmas[window_end] itself. sigmas: (N+1,) -> (window_end + points,) fp32."""
    num_steps = int(sigmas.shape[0]) - 1
    points = flash_post_points(num_steps, window_end, compress_ratio)
    if not shift > 0:
        raise InvalidRequestError("the schedule's shift must be > 0", field="shift",
                                  expected="> 0", actual=shift)
    sigma_end = sigmas[window_end].double()
    t_end = sigma_end / (shift - (shift - 1.0) * sigma_end)
    t = torch.linspace(float(t_end), 0.0, points, dtype=torch.float64)
    post = shift * t / (1.0 + (shift - 1.0) * t)
    post[0] = sigma_end
    return torch.cat([sigmas[:window_end].double(), post.to(sigmas.device)]).to(sigmas.dtype)


def check_flash(sampling: SamplingSpec) -> None:
    """A request's MixGRPO-Flash option against its own schedule: InvalidRequestError naming
    `sampling.flash_compress` or `sampling.sde_window` (the window must end before the last
    step and leave >= 2 points after it)."""
    if sampling.flash_compress is None:
        return
    try:
        flash_post_points(sampling.num_steps, sampling.window[1], sampling.flash_compress)
    except InvalidRequestError as exc:
        field = {"window_end": "sampling.sde_window"}.get(exc.field, "sampling.flash_compress")
        raise InvalidRequestError(exc.message, field=field, expected=exc.expected,
                                  actual=sampling.window if field.endswith("window")
                                  else sampling.flash_compress) from None


def flash_sigmas(sigmas: torch.Tensor, sampling: SamplingSpec, shift: float) -> torch.Tensor:
    """The request's table: `sigmas` as is, or `flash_schedule` of it after the SDE window when
    the request asks for MixGRPO-Flash (`sampling.flash_compress`)."""
    if sampling.flash_compress is None:
        return sigmas
    check_flash(sampling)
    return flash_schedule(sigmas, sampling.window[1], sampling.flash_compress, shift)


def check_flash_table(sampling: SamplingSpec, table_steps: int,
                      request_id: str | None = None) -> None:
    """A request's table under MixGRPO-Flash has window_end + flash_post_points - 1 steps (the
    family's `request_sigmas` compressed it); any other count would run the solver on an
    uncompressed table. InvalidRequestError naming `sampling.flash_compress`."""
    check_flash(sampling)
    end = sampling.window[1]
    want = end + flash_post_points(sampling.num_steps, end, sampling.flash_compress) - 1
    if table_steps != want:
        raise InvalidRequestError("this sigma table is not MixGRPO-Flash's compressed schedule "
                                  "for the request", field="sampling.flash_compress",
                                  expected=f"{want} steps", actual=f"{table_steps} steps",
                                  request_id=request_id)
