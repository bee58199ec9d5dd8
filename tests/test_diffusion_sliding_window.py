"""MixGRPO's sliding SDE window against its reference code, iteration by iteration.

Excerpt cut to the lines used from Tencent-Hunyuan/MixGRPO
e5cdd6a427778d8c8b2e7a48ce16972141adbe7c, fastvideo/utils/grpo_states.py (GRPOTrainingStates,
its "progressive" strategy), as fastvideo/train_grpo_flux.py drives it: max_timesteps =
sampling_steps - 2, the window read with get_current_timesteps() before update_iteration().
"""
from __future__ import annotations

import itertools

import pytest

from contract.errors import InvalidRequestError
from diffusion import sliding_sde_window, sliding_window_exhausted, uses_sde


class RefProgressiveStates:
    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap=False,
                 prog_overlap_step=1, roll_back=False):
        self.iters_per_group = iters_per_group
        self.group_size = group_size
        self.max_timesteps = max_timesteps
        self.cur_timestep = 0
        self.cur_iter_in_group = 0
        self.prog_overlap = prog_overlap
        self.prog_overlap_step = prog_overlap_step
        self.roll_back = roll_back
        self.init_timestep = self.cur_timestep

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            if self.prog_overlap:
                self.cur_timestep += self.prog_overlap_step
            else:
                self.cur_timestep += self.group_size
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.roll_back_start()
            else:
                self.cur_timestep = self.max_timesteps

    def roll_back_start(self):
        self.cur_timestep = self.init_timestep
        self.cur_iter_in_group = 0

    def get_current_timesteps(self):
        return list(range(self.cur_timestep,
                          min(self.cur_timestep + self.group_size, self.max_timesteps)))


CASES = list(itertools.product([6, 10, 16, 25], [1, 2, 4], [1, 3, 25], [None, 1, 2],
                               [False, True]))


@pytest.mark.parametrize("num_steps,size,shift_every,stride,roll_back", CASES)
def test_windows_equal_mixgrpos_progressive_states(num_steps, size, shift_every, stride,
                                                   roll_back):
    if size > num_steps - 2:
        pytest.skip("a window longer than the trainable steps is refused (tested below)")
    ref = RefProgressiveStates(shift_every, size, num_steps - 2, prog_overlap=stride is not None,
                               prog_overlap_step=stride or 1, roll_back=roll_back)
    exhausted = sliding_window_exhausted(num_steps, size, shift_every, stride, roll_back)
    seen_empty = None
    for iteration in range(2 * (num_steps + 2) * shift_every):   # past the end, twice
        steps = ref.get_current_timesteps()
        ref.update_iteration()
        if not steps:
            seen_empty = iteration if seen_empty is None else seen_empty
            with pytest.raises(InvalidRequestError) as e:
                sliding_sde_window(iteration, num_steps, size, shift_every, stride, roll_back)
            assert e.value.field == "iteration"
            continue
        window = sliding_sde_window(iteration, num_steps, size, shift_every, stride, roll_back)
        assert [i for i in range(num_steps) if uses_sde(i, window)] == steps
    assert exhausted == seen_empty          # the config check names the first empty iteration


def test_the_window_slides_from_the_first_step():
    # MixGRPO's defaults at 16 steps (group_size 4, iters_per_group 25): 0-4, 4-8, 8-12, 12-14
    windows = [sliding_sde_window(k, 16, 4, 25) for k in (0, 24, 25, 50, 75, 99)]
    assert windows == [(0, 4), (0, 4), (4, 8), (8, 12), (12, 14), (12, 14)]
    assert sliding_window_exhausted(16, 4, 25, None, False) == 100
    assert sliding_window_exhausted(16, 4, 25, None, True) is None


@pytest.mark.parametrize("args,field", [
    ((0, 2, 1, 1), "num_steps"),
    ((0, 10, 9, 1), "size"),
    ((0, 10, 0, 1), "size"),
    ((0, 10, 2, 0), "shift_every"),
    ((-1, 10, 2, 1), "iteration"),
    ((0, 10, 2, 1, 9), "stride"),
])
def test_bad_sliding_window_arguments(args, field):
    with pytest.raises(InvalidRequestError) as e:
        sliding_sde_window(*args)
    assert e.value.field == field
