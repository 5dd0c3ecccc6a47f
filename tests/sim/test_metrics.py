"""Per-pod recording and the published curve sampling, on hand-computed cases."""

from __future__ import annotations

import pytest

from octacloud.core.model import Request
from octacloud.sim.metrics import ARRIVED_PERCENTS, DecisionStats, RunRecorder, sample_curve, shape_key, value_at

CAPACITY = 10_000  # 10 GPUs: 1 % of capacity is 100 milli


def test_curve_has_a_point_per_arrived_percent_0_to_130() -> None:
    curve = sample_curve([0], [0], CAPACITY)
    assert len(curve) == len(ARRIVED_PERCENTS) == 131
    assert curve[0] == 0.0 and curve[1] == 0.0 and curve[2] is None


def test_value_is_the_mean_of_rows_rounded_to_that_arrived_percent() -> None:
    # arrived 100 and 140 milli round to 1 %, 250 rounds half-to-even to 2 %, 260 to 3 %.
    arrived = [100, 140, 250, 260]
    allocated = [100, 120, 200, 260]
    curve = sample_curve(arrived, allocated, CAPACITY)
    assert curve[1] == pytest.approx((1.0 + 1.2) / 2)
    assert curve[2] == 2.0
    assert curve[3] == 2.6


def test_missing_point_falls_back_to_neighbours() -> None:
    # Nothing rounds to 5 %: its value is the mean over the rows at 4 % and 6 %.
    curve = sample_curve([400, 600], [300, 500], CAPACITY)
    assert curve[5] == 4.0
    assert curve[4] == 3.0 and curve[6] == 5.0
    assert curve[8] is None  # no row within 7..9


def test_rows_are_rounded_to_two_decimals_before_averaging_for_allocation_only() -> None:
    # 1 milli of 10,000 is 0.01 %, 0.4 milli is 0.004 % → rounded away for allocation, kept for fragmentation.
    assert sample_curve([0], [0.4], CAPACITY)[0] == 0.0
    assert sample_curve([0, 0], [0.4, 0.8], CAPACITY, round_rows=False)[0] == 0.01


def test_mismatched_lengths_are_an_error() -> None:
    with pytest.raises(ValueError, match="2 arrived values but 1"):
        sample_curve([1, 2], [1], CAPACITY)


def test_recorder_counts_failures_by_shape_and_accumulates_arrivals() -> None:
    rec = RunRecorder(CAPACITY)
    share = Request("a", num_gpu=1, gpu_milli=500)
    multi = Request("b", num_gpu=2, gpu_milli=1000, gpu_models=frozenset({"V100M32", "A10"}))
    cpu = Request("c", cpu_milli=1000)
    rec.record(share, True, 500, 10.0, 0.001)
    rec.record(multi, False, 500, 20.0, 0.003)
    rec.record(cpu, False, 500, 20.0, 0.002)
    assert list(rec.arrived_milli) == [500, 2500, 2500]
    assert (rec.placed, rec.failed, len(rec)) == (1, 2, 3)
    assert rec.failed_by_shape == {"2x1000@A10|V100M32": 1, "cpu": 1}
    assert rec.total_gpus == 10
    assert rec.final_frag_rate() == pytest.approx(100 * 20 / 9500)
    stats = rec.decision_stats()
    assert stats.decisions == 3 and stats.per_second == pytest.approx(3 / 0.006)


def test_shape_keys() -> None:
    assert shape_key(Request("x", num_gpu=1, gpu_milli=460)) == "1x460"
    assert shape_key(Request("x", num_gpu=1, gpu_milli=460, gpu_models=frozenset({"T4"}))) == "1x460@T4"
    assert shape_key(Request("x")) == "cpu"


def test_decision_stats_percentiles() -> None:
    stats = DecisionStats.of([0.001] * 99 + [0.101])
    assert stats.p50_ms == pytest.approx(1.0)
    assert stats.p99_ms == pytest.approx(2.0)  # linear interpolation between the 99th and 100th values
    assert DecisionStats.of([]).per_second == 0.0


def test_value_at_outside_the_curve_is_none() -> None:
    assert value_at([1.0], 5) is None and value_at([1.0], 0) == 1.0
