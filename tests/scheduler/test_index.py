"""The indexed runner (one node per class of equal nodes) against the exhaustive one, decision by decision.

Two schedulers with the same profile and seed run on two copies of one fleet; every request goes to both and the
decisions (placement, cards, score, the reasons per filter) must be equal, while allocations are released, nodes
and cards fail and recover, and transactions roll back between decisions. The comparison is shown to fail when
the index skips a feasible class or a plugin wrongly declares itself node-local.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from octacloud.core import Gpu, Health, Node, Request
from octacloud.scheduler.actions.defragment import _targets
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework import (
    ClusterState,
    CycleContext,
    Decision,
    Scheduler,
    Transaction,
    min_max_normalize,
)
from octacloud.scheduler.framework.index import NodeClasses
from octacloud.scheduler.framework.runner import WeightedScorer
from octacloud.scheduler.policies import build_profile, policy_names
from octacloud.scheduler.telemetry import StaticTelemetry
from octacloud.sim.protocol import inflate
from octacloud.sim.traces import read_nodes, read_pods
from tests.scheduler.helpers import check_invariants, require_traces

FALLBACK = {"random", "clustering", "cpu-idle-sketch", "multi-objective", "domain-aware"}
"""Profiles with a plugin that is not node-local (or a random choice): the runner visits every node
(domain-aware's domain-reserve needs a backup spot outside the candidate's rack)."""


def telemetry_for(nodes: Sequence[Node], seed: int) -> StaticTelemetry:
    rng = random.Random(seed)
    metrics = ("gpu_utilisation", "gpu_memory_bandwidth", "network_latency_us", "network_load", "power_price")
    return StaticTelemetry({n.name: {m: round(rng.random(), 2) for m in metrics} for n in nodes if rng.random() < 0.9})


@dataclass
class Twins:
    exhaustive: Scheduler
    indexed: Scheduler
    decisions: int = 0

    def compare(self, request: Request, *, commit: bool = True, **where: object) -> Decision:
        a = self.exhaustive.decide(request, **where)  # type: ignore[arg-type]
        b = self.indexed.decide(request, **where)  # type: ignore[arg-type]
        self.decisions += 1
        assert (b.request, b.placement, b.score, b.reasons) == (a.request, a.placement, a.score, a.reasons), (
            f"decision {self.decisions} for {request}: exhaustive {a.explain()} score {a.score} {a.reasons}; "
            f"indexed {b.explain()} score {b.score} {b.reasons}"
        )
        if commit and a.placement is not None:
            self.exhaustive.commit(a.request, a.placement)
            self.indexed.commit(b.request, b.placement)  # type: ignore[arg-type]
        return a

    def both(self) -> Iterator[ClusterState]:
        yield self.exhaustive.state
        yield self.indexed.state


def twins(nodes: Sequence[Node], policy: str, workload: TargetWorkload, seed: int, *, rules: bool = False) -> Twins:
    telemetry = telemetry_for(nodes, seed)

    def make(indexed: bool) -> Scheduler:
        profile = build_profile(policy, seed=seed, workload=workload, rules=rules, telemetry=telemetry)
        return Scheduler(ClusterState(nodes), profile, indexed=indexed)

    return Twins(make(False), make(True))


def replay(t: Twins, requests: Sequence[Request], seed: int, *, churn: float = 0.15) -> int:
    """Every request through both schedulers, with releases, failures, probes and rollbacks in between."""
    rng = random.Random(seed)
    state = t.exhaustive.state
    names = [n.name for n in state.nodes]
    placed = 0
    for k, r in enumerate(requests):
        placed += t.compare(r).placement is not None
        roll = rng.random()
        if roll < churn and state.allocations:
            victim = rng.choice(sorted(state.allocations))
            for s in t.both():
                s.release(victim)
        elif roll < churn + 0.01:
            name, health = rng.choice(names), rng.choice([Health.FAILED, Health.DEGRADED, Health.HEALTHY])
            for s in t.both():
                s.set_node_health(name, health)
        elif roll < churn + 0.02:
            i = rng.randrange(len(names))
            if state.nodes[i].gpu_count:
                g = rng.randrange(state.nodes[i].gpu_count)
                health = rng.choice([Health.FAILED, Health.HEALTHY])
                for s in t.both():
                    s.set_card_health(names[i], g, health)
        elif roll < churn + 0.05:  # probes over all nodes but a few, as preemption and defragmentation ask
            probe = replace(r, name=f"probe-{k}")
            left_out = rng.sample(range(len(names)), rng.randint(1, 3))
            t.compare(probe, commit=False, exclude=left_out)
            t.compare(probe, commit=False, nodes=[i for i in range(len(names)) if i not in left_out])
            t.compare(probe, commit=False, nodes=left_out)
        elif roll < churn + 0.07 and state.allocations:  # a move tried and rolled back (on a usable node)
            victim = rng.choice(sorted(state.allocations))
            held = state.allocations[victim]
            if not all(state.card_usable(held.node_index, g) for g in held.placement.gpus):
                continue
            for s in t.both():
                with Transaction(s) as tx:
                    tx.evict(victim)
            assert victim in t.indexed.state.allocations
    for s in t.both():
        check_invariants(s)
    assert t.exhaustive.state.allocations.keys() == t.indexed.state.allocations.keys()
    return placed


def openb(folder: Path, pods_file: str, every: int) -> tuple[list[Node], list[Request], TargetWorkload]:
    nodes = read_nodes(folder / "openb_node_list_gpu_node.csv")[::every]
    pods = [p.request for p in read_pods(folder / pods_file)]
    return nodes, pods, TargetWorkload.from_requests(pods)


@pytest.mark.traces
@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize(
    ("pods_file", "seed"), [("openb_pod_list_default.csv", 3), ("openb_pod_list_multigpu50.csv", 7)]
)
def test_every_profile_decides_as_the_exhaustive_search_on_an_openb_slice(
    policy: str, pods_file: str, seed: int
) -> None:
    nodes, pods, workload = openb(require_traces(), pods_file, 8)
    capacity = sum(n.gpu_milli for n in nodes)
    requests = inflate(pods, seed=seed, tune=1.3, capacity_milli=capacity)
    t = twins(nodes, policy, workload, seed)
    placed = replay(t, requests, seed)
    assert len(requests) // 2 < placed < len(requests)  # driven to full, where requests stop fitting
    assert t.exhaustive.state.utilisation() > 0.6
    assert (t.indexed._classes is None) == (policy in FALLBACK)


@pytest.mark.traces
@pytest.mark.parametrize(("policy", "rules"), [("octacloud", True), ("octacloud", False), ("fgd", False)])
def test_octacloud_and_fgd_decide_as_the_exhaustive_search_on_the_whole_openb_fleet(policy: str, rules: bool) -> None:
    nodes, pods, workload = openb(require_traces(), "openb_pod_list_default.csv", 1)
    requests = inflate(pods, seed=11, tune=1.3, capacity_milli=sum(n.gpu_milli for n in nodes))[:700]
    t = twins(nodes, policy, workload, 11, rules=rules)
    replay(t, requests, 11)
    assert t.indexed._classes is not None


def generated_fleet(seed: int) -> list[Node]:
    """8-card nodes of four models in uneven numbers, some with NVLink pairs, many identical (large classes)."""
    rng = random.Random(seed)
    kinds = [("A100-SXM4-80GB", 81_920, 30), ("H800", 81_920, 6), ("A10", 24_576, 20), ("L40", 49_152, 10)]
    nodes: list[Node] = []
    for model, mib, count in kinds:
        for k in range(count):
            nvlink = [g // 2 for g in range(8)] if k % 3 == 0 else [None] * 8
            cpu = rng.choice([96_000, 128_000])
            gpus = tuple(Gpu(g, model, mib, nvlink[g]) for g in range(8))
            nodes.append(Node(f"{model}-{k}", cpu, 1_048_576, gpus, {"zone": f"z{k % 2}"}))
    rng.shuffle(nodes)
    return nodes


def generated_requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    models = ["A100-SXM4-80GB", "H800", "A10", "L40"]
    out: list[Request] = []
    for k in range(count):
        shape = rng.random()
        if shape < 0.5:
            n, milli = 1, rng.choice([125, 250, 300, 500, 750])
        elif shape < 0.8:
            n, milli = 1, 1000
        else:
            n, milli = rng.choice([2, 4, 8]), 1000
        restricted = frozenset(rng.sample(models, rng.randint(1, 2))) if rng.random() < 0.3 else frozenset()
        out.append(
            Request(
                f"g{k}",
                num_gpu=n,
                gpu_milli=milli,
                gpu_memory_mib=rng.choice([0, 0, 0, 4096, 20_000]),
                cpu_milli=rng.choice([1000, 4000, 8000, 16_000]),
                memory_mib=rng.choice([4096, 16_384, 65_536]),
                gpu_models=restricted,
                priority=rng.choice([0, 0, 1]),
            )
        )
    return out


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("seed", [1, 2])
def test_every_profile_decides_as_the_exhaustive_search_on_a_generated_fleet(policy: str, seed: int) -> None:
    nodes = generated_fleet(seed)
    requests = generated_requests(seed, 900)
    workload = TargetWorkload.from_requests(requests)
    t = twins(nodes, policy, workload, seed, rules=policy in ("octacloud", "spread"))
    replay(t, requests, seed, churn=0.25)
    assert t.exhaustive.state.utilisation() > 0.5


# ---- the comparison can fail ---------------------------------------------------------------------------


def test_the_comparison_fails_when_the_index_skips_a_feasible_class(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = generated_fleet(3)
    requests = generated_requests(3, 300)
    workload = TargetWorkload.from_requests(requests)
    real = NodeClasses.feasibility

    def skipping(self: NodeClasses, *args: object, **kwargs: object) -> object:
        f = real(self, *args, **kwargs)  # type: ignore[arg-type]
        if len(f.feasible) > 1:
            f.feasible.discard(min(f.feasible, key=lambda c: self.rank[self.first(c)]))  # the first node's class
        return f

    monkeypatch.setattr(NodeClasses, "feasibility", skipping)
    t = twins(nodes, "fgd", workload, 3)
    with pytest.raises(AssertionError, match="exhaustive"):
        replay(t, requests, 3)


@dataclass(slots=True)
class ByName:
    """A scorer that prefers nodes by name, wrongly declared node-local."""

    node_local = True
    name: str = "by-name"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        return [float(hash(ctx.state.nodes[i].name) % 100) for i in nodes]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return scores


def test_the_comparison_fails_for_a_plugin_wrongly_declared_node_local() -> None:
    nodes = generated_fleet(4)
    requests = generated_requests(4, 200)
    t = twins(nodes, "spread", TargetWorkload.from_requests(requests), 4)
    for s in (t.exhaustive, t.indexed):
        s.profile.scorers.append(WeightedScorer(ByName(), 1.0))
    with pytest.raises(AssertionError, match="exhaustive"):
        replay(t, requests, 4)


@dataclass(slots=True)
class Undeclared:
    """A node-local scorer that does not say so."""

    name: str = "undeclared"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        return [float(sum(ctx.state.free_gpu[i])) for i in nodes]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return min_max_normalize(scores)


def test_an_undeclared_plugin_makes_the_runner_visit_every_node() -> None:
    nodes = generated_fleet(5)
    requests = generated_requests(5, 100)
    t = twins(nodes, "spread", TargetWorkload.from_requests(requests), 5)
    for s in (t.exhaustive, t.indexed):
        s.profile.scorers.append(WeightedScorer(Undeclared(), 1.0))
    replay(t, requests, 5)
    assert t.indexed._classes is None


# ---- the classes themselves ----------------------------------------------------------------------------


def test_classes_group_equal_nodes_and_keep_the_rank_order_and_free_gpu_per_model_through_changes() -> None:
    nodes = generated_fleet(6)
    requests = generated_requests(6, 400)
    scheduler = Scheduler(ClusterState(nodes), build_profile("spread", seed=6, rules=True))
    state = scheduler.state
    classes = scheduler.classes()
    rng = random.Random(6)
    for r in requests:
        scheduler.schedule(r)
        if rng.random() < 0.2 and state.allocations:
            state.release(rng.choice(sorted(state.allocations)))
        if rng.random() < 0.02:
            state.set_node_health(rng.choice(nodes).name, rng.choice([Health.FAILED, Health.HEALTHY]))
    groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, n in enumerate(state.nodes):
        key = (n.cpu_milli, n.memory_mib, n.gpus, tuple(sorted(n.labels.items())), n.health)
        groups[(*key, state.free_cpu[i], state.free_memory[i], tuple(state.free_gpu[i]))].append(i)
    by_class: dict[int, list[int]] = defaultdict(list)
    for i in range(len(state)):
        by_class[classes.of[i]].append(i)
    assert sorted(map(sorted, groups.values())) == sorted(map(sorted, by_class.values()))
    assert classes.nonempty == set(by_class)
    for cid, members in by_class.items():
        assert classes.size[cid] == len(members)
        assert classes.first(cid) == min(members, key=scheduler.tie_rank.__getitem__)
        assert classes.first_not_in(cid, set(members)) is None
    free: dict[str, int] = {}
    for sig in state.signature:
        if sig.free_gpu:
            free[sig.gpu_model] = free.get(sig.gpu_model, 0) + sum(sig.free_gpu)
    assert dict(state.free_gpu_milli_by_model()) == free
    empty = [cid for cid in range(len(classes.size)) if cid not in by_class]
    assert all(classes.first_not_in(cid, set()) is None for cid in empty)


def test_a_forgotten_scheduler_stops_watching_the_state() -> None:
    state = ClusterState(generated_fleet(7))
    scheduler = Scheduler(state, build_profile("spread", seed=7))
    scheduler.classes()
    assert len(state._watchers) == 1
    del scheduler
    state.set_node_health(state.nodes[0].name, Health.FAILED)
    assert state._watchers == []


def test_defragmentation_targets_ranked_per_class_are_the_targets_ranked_per_node() -> None:
    nodes = generated_fleet(8)
    requests = generated_requests(8, 700)
    scheduler = Scheduler(
        ClusterState(nodes), build_profile("fgd", seed=8, workload=TargetWorkload.from_requests(requests))
    )
    state = scheduler.state
    rng = random.Random(8)
    for r in requests[:600]:
        scheduler.schedule(r)
        if rng.random() < 0.1 and state.allocations:
            state.release(rng.choice(sorted(state.allocations)))
    classes = scheduler.node_classes
    assert classes is not None
    for r in requests[600:]:
        for limit in (4, len(state)):
            assert _targets(state, r, lambda a: not a.request.pinned, limit, classes) == _targets(
                state, r, lambda a: not a.request.pinned, limit
            )


def test_decisions_stay_equal_when_the_class_log_restarts_and_the_ids_are_renumbered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from octacloud.scheduler.framework import index

    monkeypatch.setattr(index, "LOG_LIMIT", 40)
    monkeypatch.setattr(index, "MAX_CLASSES", 150)
    monkeypatch.setattr(index, "MAX_SHAPES", 8)
    nodes = generated_fleet(9)
    requests = generated_requests(9, 500)
    t = twins(nodes, "octacloud", TargetWorkload.from_requests(requests), 9, rules=True)
    replay(t, requests, 9, churn=0.3)
    classes = t.indexed.node_classes
    assert classes is not None and classes.epoch > 3 and classes.generation > 0
