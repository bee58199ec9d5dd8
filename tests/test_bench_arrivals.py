"""The rollout benchmark's serving-policy simulators (bench/arrivals.py) against latencies worked
out by hand on small arrival traces, and its pooled summary against numpy's percentiles."""
from __future__ import annotations

import pytest

from bench.arrivals import robust_line, simulate_static, simulate_stepwise, summarize


def linear(fixed: float, per_row: float):
    return lambda rows: fixed + per_row * rows


def test_greedy_static_batcher_runs_whatever_waits_when_free():
    # 2 steps of (1 + 1 x rows) s. t=0: A alone, runs 0..4. B (t=1) and C (t=2) wait and run
    # together 4..10. D (t=20) alone 20..24.
    got = simulate_static([0.0, 1.0, 2.0, 20.0], 2, linear(1.0, 1.0), max_batch=8)
    assert got == pytest.approx([4.0, 9.0, 8.0, 4.0])


def test_max_wait_static_batcher_waits_for_a_full_batch_or_its_deadline():
    # 2 steps of (1 + 2 x rows) s, full batch = 2: A (0) waits for B (1), both run 1..11;
    # C (20) waits out its 3 s deadline and runs alone 23..29.
    got = simulate_static([0.0, 1.0, 20.0], 2, linear(1.0, 2.0), max_batch=2, max_wait_s=3.0)
    assert got == pytest.approx([11.0, 10.0, 9.0])


def test_stepwise_joins_at_the_next_step_boundary():
    # 3 steps of (1 + 1 x rows) s. A at 0: step 0..2 alone; B (t=1) joins at 2: steps 2..5,
    # 5..8 with A (A done at 8), then B alone 8..10.
    got = simulate_stepwise([0.0, 1.0], 3, linear(1.0, 1.0), max_rows=4)
    assert sorted(got) == pytest.approx([8.0, 9.0])


@pytest.mark.parametrize("order, want", [
    # 2 steps of 1 s, one row per step. fair (least recently stepped first): A0 B0 A1 B1 ->
    # A done at 3, B at 4. oldest: A0 A1 B0 B1 -> A at 2, B at 4.
    ("fair", [3.0, 4.0]), ("oldest", [2.0, 4.0])])
def test_stepwise_row_bound_picks_by_its_order(order, want):
    got = simulate_stepwise([0.0, 0.0], 2, lambda rows: 1.0, max_rows=1, order=order)
    assert got == pytest.approx(want)


def test_robust_line_ignores_one_point_bent_by_load():
    # 1 + 2 x rows at rows 1..5, the point at 3 rows hit by a burst (x5): least squares would
    # move both coefficients; Theil-Sen keeps the line.
    fixed, per_row = robust_line([1, 2, 3, 4, 5], [3.0, 5.0, 35.0, 9.0, 11.0])
    assert (fixed, per_row) == pytest.approx((1.0, 2.0))


def test_summary_pools_the_traces():
    import numpy as np
    traces = [{"makespan_s": 2.0, "samples": 2, "latency_s": [1.0, 2.0], "wait_s": [0.5, 0.0],
               "rows": [1.0, 2.0]},
              {"makespan_s": 6.0, "samples": 2, "latency_s": [3.0, 10.0], "wait_s": [1.0, 4.0],
               "rows": [2.0, 3.0]}]
    got = summarize(traces)
    assert got["samples_per_s"] == pytest.approx(4 / 8)
    assert got["latency_p95_s"] == pytest.approx(np.percentile([1, 2, 3, 10], 95))
    assert got["run_p95_s"] == pytest.approx(np.percentile([0.5, 2.0, 2.0, 6.0], 95))
    assert got["rows_per_forward_mean"] == pytest.approx(2.0)
