"""Runs of the published protocol: one (trace, policy, seed) per run, many runs in parallel processes.

A run reads the fleet and the pods, builds FGD's target workload from the original pods, inflates the shuffled
trace to ``tune`` × capacity (:func:`octacloud.sim.protocol.inflate`), places the pods one by one
(:func:`octacloud.sim.protocol.replay`) and records after every pod the cluster's allocation and
fragmentation (:class:`~octacloud.scheduler.fragmentation.FragmentationTracker`, updated only on the node that
changed). Every run is a pure function of its :class:`RunSpec`, so ``jobs`` changes the wall time, never the
results.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from octacloud.core.clock import ManualClock
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node, Request
from octacloud.scheduler.fragmentation import FragmentationTracker, TargetWorkload
from octacloud.scheduler.framework import ClusterState, Decision, Scheduler
from octacloud.scheduler.loop import DEFAULT_RESERVATIONS, LoopSettings, ReevaluationLoop
from octacloud.scheduler.policies import POLICY_IDS, build_profile, policy_names
from octacloud.sim.bound import ChurnBound, arrived_prefix, churn_bound, packing_bound
from octacloud.sim.churn import ChurnReport, ChurnSimulation, ReevaluationHook
from octacloud.sim.metrics import Curve, RunRecorder, value_at
from octacloud.sim.protocol import inflate, replay
from octacloud.sim.reevaluate import LoopHook
from octacloud.sim.synthetic import Lifetime, PoissonArrivals, offered_load, synthetic_arrivals
from octacloud.sim.traces import read_gpu_memory_table, read_nodes, read_pods

S = TypeVar("S")
R = TypeVar("R")

DEFAULT_TUNE = 1.3


def published_policy_id(policy: str) -> str:
    """The published name of a policy (``06-FGD`` for ``fgd``); our own policies keep their CLI name."""
    return POLICY_IDS.get(policy, policy)


def workload_name(pods: Path) -> str:
    """The published ``workload`` column: the pods file's stem (``openb_pod_list_default``)."""
    return pods.stem


def check_policies(names: Sequence[str]) -> list[str]:
    """The policy names, validated: built-in profiles or profile files that load. Raises
    :class:`InvalidSpecError` naming the bad one."""
    known = policy_names()
    if not names:
        raise InvalidSpecError(f"--policy: give at least one policy ({', '.join(known)})")
    if len(set(names)) != len(names):
        raise InvalidSpecError(f"--policy: a policy appears twice in {','.join(names)}")
    probe = TargetWorkload.from_requests([Request("probe", num_gpu=1, gpu_milli=500)])
    for name in names:
        if name in known:
            continue
        if not name.endswith((".yaml", ".yml", ".toml")):
            raise InvalidSpecError(f"--policy: unknown policy {name!r}; known: {', '.join(known)} or a profile file")
        build_profile(name, seed=0, workload=probe)  # a profile file: its own errors name the file and key
    return list(names)


def parse_seeds(text: str) -> list[int]:
    """``42-51`` → 42..51; ``42,45,50-51`` → [42, 45, 50, 51]. Raises :class:`InvalidSpecError` with the reason."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise InvalidSpecError(f"--seeds {text!r}: empty item; use e.g. 42-51 or 42,43,44")
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise InvalidSpecError(f"--seeds {text!r}: {part!r} is not a seed or a range like 42-51") from None
        if lo < 0 or hi < lo:
            raise InvalidSpecError(f"--seeds {text!r}: range {part!r} must be non-negative and ascending")
        seeds.extend(range(lo, hi + 1))
    if len(set(seeds)) != len(seeds):
        raise InvalidSpecError(f"--seeds {text!r}: a seed appears twice")
    return seeds


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run: a fleet, a trace, a policy, a seed and the inflation factor."""

    nodes: Path
    pods: Path
    policy: str
    seed: int
    tune: float = DEFAULT_TUNE
    gpu_memory: Path | None = None
    """A ``model,gpu_memory_mib`` table for fleets whose models the built-in table lacks (``--gpu-memory``)."""
    bound: bool = True
    """Also compute the LP lower bound on unallocated GPU % at 100 % arrived for this seed's pods."""

    @property
    def workload(self) -> str:
        return workload_name(self.pods)

    @property
    def sc_policy(self) -> str:
        return published_policy_id(self.policy)


@dataclass(frozen=True, slots=True)
class RunResult:
    """What one run measured: the published curves and a summary."""

    spec: RunSpec
    total_gpus: int
    pods: int
    placed: int
    failed: int
    failed_by_shape: dict[str, int]
    alloc_curve: Curve
    frag_curve: Curve
    final_frag_rate: float
    decisions_per_second: float
    p50_decision_ms: float
    p99_decision_ms: float
    wall_seconds: float
    cpu_seconds: float
    """CPU time of the run in its process: the figure to read when other work shares the machine."""
    lower_bound_pct: float | None = None
    """LP lower bound on unallocated GPU % at 100 % arrived for this seed's pods (:mod:`octacloud.sim.bound`)."""

    def unallocated_at(self, arrived_percent: int) -> float | None:
        """Unallocated GPU % (100 − allocation ratio) at an arrived %, ``None`` where the curve has a gap."""
        value = value_at(self.alloc_curve, arrived_percent)
        return None if value is None else round(100.0 - value, 2)

    def summary(self) -> dict[str, object]:
        """The run's entry in ``summary.json``."""
        return {
            "workload": self.spec.workload,
            "policy": self.spec.policy,
            "sc_policy": self.spec.sc_policy,
            "seed": self.spec.seed,
            "tune": self.spec.tune,
            "total_gpus": self.total_gpus,
            "pods": self.pods,
            "placed": self.placed,
            "failed": self.failed,
            "failed_by_shape": dict(sorted(self.failed_by_shape.items(), key=lambda kv: (-kv[1], kv[0]))),
            "unallocated_gpu_pct_at_100": self.unallocated_at(100),
            "unallocated_gpu_pct_at_130": self.unallocated_at(130),
            "frag_gpu_pct_at_100": value_at(self.frag_curve, 100),
            "final_frag_rate_pct": round(self.final_frag_rate, 2),
            "decisions_per_second": round(self.decisions_per_second, 1),
            "p50_decision_ms": round(self.p50_decision_ms, 3),
            "p99_decision_ms": round(self.p99_decision_ms, 3),
            "wall_seconds": round(self.wall_seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "lower_bound_unallocated_pct_at_100": self.lower_bound_pct,
        }


@dataclass(frozen=True, slots=True)
class TraceRun:
    """Outcome of placing a sequence of requests on an empty fleet (the ``octacloud schedule`` summary)."""

    recorder: RunRecorder
    state: ClusterState


def place(
    nodes: Sequence[Node],
    requests: Sequence[Request],
    *,
    policy: str,
    seed: int,
    workload: TargetWorkload,
) -> TraceRun:
    """Place ``requests`` in order on an empty fleet with ``policy``, recording metrics after every pod."""
    state = ClusterState(nodes)
    scheduler = Scheduler(state, build_profile(policy, seed=seed, workload=workload))
    tracker = FragmentationTracker(state, workload)
    recorder = RunRecorder(state.total_gpu_milli)
    index = state.index

    def on_pod(_: int, request: Request, decision: Decision, seconds: float) -> None:
        placement = decision.placement
        if placement is not None:
            tracker.update(index[placement.node])
        recorder.record(request, placement is not None, state.allocated_gpu_milli, tracker.total, seconds)

    replay(scheduler, requests, on_pod)
    return TraceRun(recorder, state)


@functools.lru_cache(maxsize=4)
def _load(nodes: Path, pods: Path, gpu_memory: Path | None = None) -> tuple[tuple[Node, ...], tuple[Request, ...]]:
    """Read a fleet and a trace once per process (a worker runs many seeds of the same files)."""
    table = None if gpu_memory is None else read_gpu_memory_table(gpu_memory)
    return tuple(read_nodes(nodes, gpu_memory=table)), tuple(p.request for p in read_pods(pods))


@functools.lru_cache(maxsize=64)
def seed_lower_bound(nodes: Path, pods: Path, gpu_memory: Path | None, seed: int, tune: float) -> float:
    """The LP lower bound of one seed's pod sequence (cached: every policy of a seed shares it)."""
    fleet, original = _load(nodes, pods, gpu_memory)
    capacity = sum(n.gpu_milli for n in fleet)
    requests = inflate(original, seed=seed, tune=tune, capacity_milli=capacity)
    return packing_bound(fleet, arrived_prefix(requests, capacity)).unallocated_pct


def run(spec: RunSpec) -> RunResult:
    """Run the published protocol once. Deterministic in ``spec``."""
    started, cpu_started = time.perf_counter(), time.process_time()
    nodes, original = _load(spec.nodes, spec.pods, spec.gpu_memory)
    capacity = sum(n.gpu_milli for n in nodes)
    workload = TargetWorkload.from_requests(original)
    requests = inflate(original, seed=spec.seed, tune=spec.tune, capacity_milli=capacity)
    recorder = place(nodes, requests, policy=spec.policy, seed=spec.seed, workload=workload).recorder
    stats = recorder.decision_stats()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    bound = seed_lower_bound(spec.nodes, spec.pods, spec.gpu_memory, spec.seed, spec.tune) if spec.bound else None
    return RunResult(
        spec=spec,
        total_gpus=recorder.total_gpus,
        pods=len(recorder),
        placed=recorder.placed,
        failed=recorder.failed,
        failed_by_shape=dict(recorder.failed_by_shape),
        alloc_curve=recorder.alloc_curve(),
        frag_curve=recorder.frag_curve(),
        final_frag_rate=recorder.final_frag_rate(),
        decisions_per_second=stats.per_second,
        p50_decision_ms=stats.p50_ms,
        p99_decision_ms=stats.p99_ms,
        wall_seconds=wall,
        cpu_seconds=cpu,
        lower_bound_pct=bound,
    )


def run_many(
    specs: Sequence[RunSpec],
    *,
    jobs: int = 1,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every spec of the published protocol; results come back in ``specs`` order (see :func:`run_parallel`)."""
    return run_parallel(run, specs, jobs=jobs, on_result=on_result)


def run_parallel(
    fn: Callable[[S], R],
    specs: Sequence[S],
    *,
    jobs: int = 1,
    on_result: Callable[[R], None] | None = None,
) -> list[R]:
    """``[fn(s) for s in specs]``, in ``jobs`` worker processes when > 1; results come back in ``specs`` order.

    ``fn`` must be a module-level function and every run a pure function of its spec, so that ``jobs`` changes
    the wall time, never the results. ``on_result`` is called in this process as each run finishes (for a
    progress bar). If a run raises, the runs not yet started are cancelled and the error propagates.
    """
    if jobs < 1:
        raise InvalidSpecError(f"--jobs must be >= 1, got {jobs}")
    results: dict[int, R] = {}
    if jobs == 1 or len(specs) <= 1:
        for k, spec in enumerate(specs):
            results[k] = fn(spec)
            if on_result is not None:
                on_result(results[k])
        return [results[k] for k in range(len(specs))]
    # spawn, not fork: the parent may run threads (rich's progress refresher) that fork would copy mid-lock.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context) as pool:
        pending: dict[Future[R], int] = {pool.submit(fn, spec): k for k, spec in enumerate(specs)}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    k = pending.pop(future)
                    results[k] = future.result()
                    if on_result is not None:
                        on_result(results[k])
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return [results[k] for k in range(len(specs))]


# ---- churn mode -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChurnSpec:
    """One churn run: trace-shaped requests arriving and departing on simulated time."""

    nodes: Path
    pods: Path
    policy: str
    seed: int
    arrivals: PoissonArrivals
    lifetime: Lifetime
    duration: float
    queue: bool = False
    period: float = 5.0
    warmup: float = 0.0
    defrag_moves: int = 0
    """Defragment with up to this many moves per pass (0: none)."""
    gpu_memory: Path | None = None
    reservations: int = DEFAULT_RESERVATIONS
    """Queued requests that may hold a reservation (the loop's queue discipline; 0: plain greedy retry)."""
    serve_releases: bool = True
    """With the loop: capacity a departure frees goes to the queue at once (:meth:`ReevaluationLoop.offer`)."""

    @property
    def workload(self) -> str:
        return workload_name(self.pods)


@dataclass(frozen=True, slots=True)
class ChurnResult:
    spec: ChurnSpec
    report: ChurnReport
    offered_load_pct: float
    timeline: list[tuple[float, float]]
    """Allocated GPU % at :data:`TIMELINE_POINTS` evenly spaced instants of the run (for plots)."""
    wall_seconds: float
    moves: int = 0
    """Replica moves made by defragmentation (``defrag_moves`` > 0)."""
    moved_gpu_milli: int = 0
    bound: ChurnBound | None = None
    """Upper bounds on the time-averaged allocation of any policy for this workload (:func:`churn_bound`)."""

    def summary(self) -> dict[str, object]:
        bound = self.bound
        return {
            "workload": self.spec.workload,
            "policy": self.spec.policy,
            "seed": self.spec.seed,
            "arrivals_spec": str(self.spec.arrivals),
            "lifetime_spec": str(self.spec.lifetime),
            "queue": self.spec.queue,
            "period": self.spec.period,
            "defrag_moves_per_pass": self.spec.defrag_moves,
            "reservations": self.spec.reservations,
            "offered_load_pct": round(self.offered_load_pct, 2),
            **self.report.as_dict(),
            "moves": self.moves,
            "moved_gpu_milli": self.moved_gpu_milli,
            "bound_any_pct": bound.any_pct if bound is not None else None,
            "bound_proportional_pct": bound.proportional_pct if bound is not None else None,
            "wall_seconds": round(self.wall_seconds, 2),
        }


TIMELINE_POINTS = 400


def run_churn(spec: ChurnSpec, hooks: Sequence[ReevaluationHook] | None = None) -> ChurnResult:
    """Run churn mode once. Deterministic in ``spec`` (and ``hooks``)."""
    started = time.perf_counter()
    nodes, shapes = _load(spec.nodes, spec.pods, spec.gpu_memory)
    state = ClusterState(nodes)
    workload = TargetWorkload.from_requests(shapes)
    scheduler = Scheduler(state, build_profile(spec.policy, seed=spec.seed, workload=workload))
    arrivals = synthetic_arrivals(shapes, spec.arrivals, spec.lifetime, seed=spec.seed, until=spec.duration)
    loop_hook: LoopHook | None = None
    if spec.queue and hooks is None:  # the queue is the loop's: the same discipline as the cloud's controller
        settings = LoopSettings(
            period=spec.period,
            defragment=spec.defrag_moves > 0,
            moves_per_pass=spec.defrag_moves,
            reservations=spec.reservations,
        )
        loop_hook = LoopHook(ReevaluationLoop(scheduler, settings))
        hooks = [loop_hook]
    simulation = ChurnSimulation(
        scheduler,
        arrivals,
        until=spec.duration,
        clock=ManualClock(),
        queue=spec.queue,
        period=spec.period,
        hooks=hooks,
        warmup=spec.warmup,
        admission=loop_hook.loop.admit if loop_hook is not None else None,
        on_release=loop_hook.released if loop_hook is not None and spec.serve_releases else None,
    )
    report = simulation.run()
    load = offered_load(shapes, spec.arrivals, spec.lifetime, state.total_gpu_milli)
    wall = time.perf_counter() - started
    gpu_shapes = state.total_gpu_milli > 0 and any(s.total_gpu_milli for s in shapes)
    bound = churn_bound(nodes, shapes, spec.arrivals.rate, spec.lifetime.mean) if gpu_shapes else None
    return ChurnResult(
        spec,
        report,
        100.0 * load,
        _sample_timeline(simulation.timeline, spec.duration, state.total_gpu_milli),
        wall,
        loop_hook.moves if loop_hook is not None else 0,
        loop_hook.moved_gpu_milli if loop_hook is not None else 0,
        bound,
    )


def _sample_timeline(timeline: Sequence[tuple[float, int]], until: float, capacity: int) -> list[tuple[float, float]]:
    """The step function ``timeline`` (time, allocated milli) read at evenly spaced instants, as % of capacity."""
    out: list[tuple[float, float]] = []
    k = 0
    for step in range(TIMELINE_POINTS + 1):
        t = until * step / TIMELINE_POINTS
        while k + 1 < len(timeline) and timeline[k + 1][0] <= t:
            k += 1
        out.append((t, 100.0 * timeline[k][1] / capacity if capacity else 0.0))
    return out
