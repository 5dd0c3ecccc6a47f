"""Runs of the published protocol end to end on small fleets: counts, determinism, fragmentation, parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Node, Request
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.policies import POLICY_IDS
from octacloud.sim.experiment import (
    ChurnSpec,
    RunSpec,
    check_policies,
    parse_seeds,
    place,
    run,
    run_churn,
    run_many,
)
from octacloud.sim.protocol import inflate
from octacloud.sim.synthetic import Lifetime, PoissonArrivals
from octacloud.sim.traces import read_nodes, read_pods


@pytest.mark.parametrize(
    ("text", "seeds"), [("42-51", list(range(42, 52))), ("7", [7]), ("1,3,5-6", [1, 3, 5, 6]), ("0-0", [0])]
)
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize(
    ("text", "message"),
    [("51-42", "ascending"), ("a-b", "not a seed"), ("1,,2", "empty item"), ("1,1", "appears twice"), ("", "empty")],
)
def test_bad_seeds(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_seeds(text)


def test_policy_names_are_checked() -> None:
    assert check_policies(list(POLICY_IDS)) == list(POLICY_IDS)
    with pytest.raises(InvalidSpecError, match="unknown policy 'fastest'"):
        check_policies(["fgd", "fastest"])
    with pytest.raises(InvalidSpecError, match="appears twice"):
        check_policies(["fgd", "fgd"])


def test_run_inflates_to_tune_times_capacity_and_counts_every_pod(small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    result = run(RunSpec(nodes, pods, "fgd", 42, 1.3))
    capacity = sum(n.gpu_milli for n in read_nodes(nodes))
    original = [p.request for p in read_pods(pods)]
    inflated = inflate(original, seed=42, tune=1.3, capacity_milli=capacity)
    assert result.pods == len(inflated) > len(original)
    assert result.placed + result.failed == result.pods
    assert sum(result.failed_by_shape.values()) == result.failed
    # The arrived request reaches 1.3 × capacity, give or take one pod (up to 2 of these 7 cards).
    assert sum(r.total_gpu_milli for r in inflated) >= 1.3 * capacity - 2000
    points = [a for a, v in enumerate(result.alloc_curve) if v is not None]
    assert points[0] == 0 and points[-1] >= 100
    assert result.total_gpus == 7 and result.spec.sc_policy == "06-FGD"
    # Allocation never exceeds capacity, nor arrivals (up to the ±1.5 % of rounding and neighbour fallback).
    assert all(v is None or v <= min(a + 1.5, 100) for a, v in enumerate(result.alloc_curve))


@pytest.mark.parametrize("policy", list(POLICY_IDS))
def test_runs_are_deterministic_per_seed(small_trace: tuple[Path, Path], policy: str) -> None:
    nodes, pods = small_trace
    a = run(RunSpec(nodes, pods, policy, 42))
    b = run(RunSpec(nodes, pods, policy, 42))
    assert (a.alloc_curve, a.frag_curve, a.failed_by_shape) == (b.alloc_curve, b.frag_curve, b.failed_by_shape)


def test_different_seeds_give_different_workloads(small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    curves = {tuple(run(RunSpec(nodes, pods, "random", seed)).alloc_curve) for seed in range(42, 46)}
    assert len(curves) > 1


def test_parallel_jobs_give_the_same_results(small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    specs = [RunSpec(nodes, pods, p, s) for p in ("random", "fgd") for s in (42, 43)]
    seen: list[str] = []
    serial = run_many(specs, jobs=1)
    parallel = run_many(specs, jobs=2, on_result=lambda r: seen.append(r.spec.policy))
    assert [r.spec for r in parallel] == specs and len(seen) == 4
    assert [(r.alloc_curve, r.frag_curve, r.failed) for r in serial] == [
        (r.alloc_curve, r.frag_curve, r.failed) for r in parallel
    ]
    with pytest.raises(InvalidSpecError, match="--jobs must be >= 1"):
        run_many(specs, jobs=0)


def test_recorded_fragmentation_matches_a_hand_computed_case() -> None:
    # Target workload: only 1x500 tasks. One node with two free cards.
    workload = TargetWorkload.from_requests([Request("t", num_gpu=1, gpu_milli=500)])
    fleet = [Node("n0", 64_000, 256 * 1024, (Gpu(0, "T4", 16384), Gpu(1, "T4", 16384)))]
    requests = [Request("a", num_gpu=1, gpu_milli=700), Request("b", num_gpu=1, gpu_milli=800)]
    recorder = place(fleet, requests, policy="fgd", seed=0, workload=workload).recorder
    # After a: cards free (300, 1000); the task fits on card 1 → fragment = the 300 on card 0.
    # After b: cards free (300, 200); the task fits nowhere → fragment = all 500 idle milli.
    assert list(recorder.frag_milli) == [300.0, 500.0]
    assert list(recorder.allocated_milli) == [700, 1500]
    assert recorder.final_frag_rate() == 100.0


def test_cpu_only_and_model_restricted_shapes_count_all_idle_gpu_as_fragment() -> None:
    workload = TargetWorkload.from_requests(
        [Request("c", cpu_milli=1000), Request("v", num_gpu=1, gpu_milli=1000, gpu_models=frozenset({"V100M32"}))]
    )
    fleet = [Node("n0", 64_000, 256 * 1024, (Gpu(0, "T4", 16384),))]
    recorder = place(fleet, [Request("a", num_gpu=1, gpu_milli=250)], policy="bestfit", seed=0, workload=workload)
    # Idle 750 milli: the CPU-only half and the V100-only half can use none of it.
    assert list(recorder.recorder.frag_milli) == [750.0]


def test_churn_run_is_deterministic_and_reports_the_offered_load(small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    spec = ChurnSpec(nodes, pods, "bestfit", 1, PoissonArrivals(0.05), Lifetime("fixed", 100.0), 2000.0, queue=True)
    a, b = run_churn(spec), run_churn(spec)
    timed = ("decisions_per_second",)
    assert {k: v for k, v in a.report.as_dict().items() if k not in timed} == {
        k: v for k, v in b.report.as_dict().items() if k not in timed
    }
    assert a.timeline == b.timeline
    assert 0 < a.report.time_avg_allocated_pct < 100
    # 0.05/s × 100 s × mean 745 milli (5,960 over 8 pods) / 7,000 capacity
    assert a.offered_load_pct == pytest.approx(100 * 0.05 * 100 * 745 / 7000)
    assert len(a.timeline) == 401 and a.timeline[-1][0] == 2000.0
    assert a.summary()["arrivals_spec"] == "poisson:0.05"
