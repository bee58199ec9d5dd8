"""SDE window helpers."""
import random

import pytest

from contract.errors import InvalidRequestError
from diffusion import sample_sde_window, uses_sde


def test_uses_sde_half_open():
    assert [uses_sde(i, (2, 5)) for i in range(7)] == [False, False, True, True, True, False,
                                                       False]
    assert not any(uses_sde(i, (0, 0)) for i in range(4))


def test_window_start_covers_inclusive_range():
    rng = random.Random(0)
    draws = [sample_sde_window(10, 3, (0, 5), rng) for _ in range(400)]
    starts = {s for s, _ in draws}
    assert starts == {0, 1, 2}                         # start in [0, 5 - 3], both ends inclusive
    assert all(e - s == 3 for s, e in draws)


def test_window_exact_fit_and_determinism():
    assert sample_sde_window(10, 4, (2, 6), random.Random(1)) == (2, 6)
    a = [sample_sde_window(20, 2, (0, 10), random.Random(7)) for _ in range(3)]
    assert len(set(a)) == 1                            # same group seed -> same window


def test_one_window_shared_by_a_group():
    # a group draws once; every row of that group steps with the same SDE/ODE pattern
    window = sample_sde_window(10, 2, (0, 5), random.Random(3))
    pattern = [uses_sde(i, window) for i in range(10)]
    assert sum(pattern) == 2


@pytest.mark.parametrize("args,field", [
    ((10, 0, (0, 5)), "size"),
    ((10, 11, (0, 10)), "size"),
    ((10, 3, (0, 11)), "window_range"),
    ((10, 3, (4, 6)), "window_range"),
    ((10, 3, (5, 4)), "window_range"),
    ((0, 1, (0, 1)), "num_steps"),
])
def test_bad_window_arguments(args, field):
    with pytest.raises(InvalidRequestError) as e:
        sample_sde_window(*args, rng=random.Random(0))
    assert e.value.field == field


def test_bad_window_in_uses_sde():
    with pytest.raises(InvalidRequestError) as e:
        uses_sde(0, (3, 1))
    assert e.value.field == "window"
