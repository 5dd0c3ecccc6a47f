"""Property-based accounting: random allocate / release / transaction sequences keep every invariant, and a
rolled-back transaction restores the exact prior state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from octacloud.core import InvalidSpecError, Placement, Request
from octacloud.scheduler.framework import ClusterState, Transaction
from tests.scheduler.helpers import check_invariants, node, snapshot

NODES = [node("a", 2, cpu=8000, memory=16_384), node("b", 4, cpu=16_000, memory=32_768), node("c", 1)]

ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "release", "tx"]),
        st.integers(0, len(NODES) - 1),
        st.integers(1, 1000),
        st.integers(1, 4),
        st.integers(0, 6000),
        st.integers(0, 8000),
        st.booleans(),
    ),
    max_size=40,
)


def _request(k: int, milli: int, cards: int, cpu: int, gpu_mib: int) -> Request:
    cards = cards if milli == 1000 else 1
    return Request(f"r{k}", num_gpu=cards, gpu_milli=milli, gpu_memory_mib=gpu_mib, cpu_milli=cpu, memory_mib=cpu)


def _placement(state: ClusterState, r: Request, i: int, seed: int) -> Placement:
    count = state.nodes[i].gpu_count
    cards = tuple((seed + j) % count for j in range(min(r.num_gpu, count)))
    return Placement(r.name, state.nodes[i].name, cards, r.gpu_milli)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_the_invariants(sequence: list[tuple[str, int, int, int, int, int, bool]]) -> None:
    state = ClusterState(NODES)
    for k, (kind, i, milli, cards, cpu, gpu_mib, commit) in enumerate(sequence):
        if kind == "release":
            if state.allocations:
                state.release(sorted(state.allocations)[k % len(state.allocations)])
        elif kind == "alloc":
            r = _request(k, milli, cards, cpu, gpu_mib)
            before = snapshot(state)
            try:
                state.allocate(r, _placement(state, r, i, k))
            except InvalidSpecError:
                assert snapshot(state) == before  # a refused allocation changes nothing
        else:
            before = snapshot(state)
            with Transaction(state) as tx:
                for name in sorted(state.allocations)[:2]:
                    tx.evict(name)
                r = _request(k, milli, cards, cpu, gpu_mib)
                try:
                    tx.allocate(r, _placement(state, r, i, k))
                except InvalidSpecError:
                    pass
                check_invariants(state)
                if commit:
                    tx.commit()
            if not commit:
                assert snapshot(state) == before  # rollback restores the exact prior state
        check_invariants(state)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 1000)), min_size=1, max_size=20))
def test_checkpoint_rollback_undoes_only_later_operations(steps: list[tuple[int, int]]) -> None:
    state = ClusterState(NODES)
    with Transaction(state) as tx:
        marks = []
        for k, (i, milli) in enumerate(steps):
            marks.append((tx.checkpoint(), snapshot(state)))
            r = Request(f"r{k}", num_gpu=1, gpu_milli=milli)
            try:
                tx.allocate(r, Placement(r.name, NODES[i].name, (0,), milli))
            except InvalidSpecError:
                pass
        for mark, expected in reversed(marks):
            if mark:
                tx.rollback(mark)
                assert snapshot(state) == expected
    assert state.allocated_gpu_milli == 0
    check_invariants(state)


actions = st.lists(
    st.tuples(
        st.sampled_from(["schedule", "preempt", "release"]),
        st.sampled_from([0, 125, 300, 470, 1000]),
        st.integers(1, 3),
        st.integers(0, 16_000),  # cards have 16 GiB: above 13,107 MiB the 80 % rule refuses
        st.sampled_from([0, 0, 50, 150]),
        st.booleans(),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(actions)
def test_product_rules_hold_under_any_sequence(sequence: list[tuple[str, int, int, int, int, bool]]) -> None:
    from octacloud.scheduler.actions.preempt import preempt
    from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
    from octacloud.scheduler.framework import Scheduler
    from octacloud.scheduler.policies import build_profile
    from tests.scheduler.helpers import check_model_memory_rule

    workload = TargetWorkload((WorkloadShape(1000, 500, 1), WorkloadShape(2000, 1000, 1)), (0.5, 0.5))
    state = ClusterState(NODES)
    scheduler = Scheduler(state, build_profile("octacloud", seed=1, workload=workload, rules=True))
    for k, (kind, milli, cards, gpu_mib, priority, failover) in enumerate(sequence):
        if kind == "release":
            if state.allocations:
                state.release(sorted(state.allocations)[k % len(state.allocations)])
        else:
            r = Request(
                f"r{k}",
                num_gpu=(cards if milli == 1000 else 1) if milli else 0,
                gpu_milli=milli,
                gpu_memory_mib=gpu_mib if milli else 0,
                cpu_milli=500,
                memory_mib=512,
                priority=priority,
                failover=failover,
            )
            before = {a.request.name: a.request.priority for a in state.allocations.values()}
            if kind == "schedule":
                scheduler.schedule(r)
            else:
                result = preempt(scheduler, r)
                if result is not None:
                    assert all(before[v.request.name] < r.priority for v in result.victims)
        check_invariants(state, headroom_percent=20)
        check_model_memory_rule(state)
        assert all(a.placement.milli_per_gpu % 125 == 0 for a in state.allocations.values())
