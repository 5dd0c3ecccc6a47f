"""Plugins beyond the published baselines: health, GPU-type policy, telemetry terms, free-resource, runner checks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from octacloud.core import Health
from octacloud.scheduler.framework import ClusterState, CycleContext, PluginError, Profile, Scheduler, WeightedScorer
from octacloud.scheduler.framework.api import identity_normalize
from octacloud.scheduler.plugins.fit import ResourceFit
from octacloud.scheduler.policies import build_profile
from octacloud.scheduler.profiles import load_profile
from octacloud.scheduler.registry import PluginContext
from octacloud.scheduler.telemetry import StaticTelemetry
from tests.scheduler.helpers import check_invariants, node, req


def _fit_only(state: ClusterState) -> Scheduler:
    return Scheduler(state, Profile("fit", filters=[ResourceFit()]))


def test_failed_cards_and_unhealthy_nodes_get_no_new_work() -> None:
    state = ClusterState([node("a", 2), node("b", 2), node("c", 2)])
    state.set_card_health("a", 0, Health.FAILED)
    state.set_node_health("b", Health.DEGRADED)
    state.set_node_health("c", Health.FAILED)
    scheduler = _fit_only(state)
    first = scheduler.schedule(req("p", 1000))
    assert first.placement is not None and (first.placement.node, first.placement.gpus) == ("a", (1,))
    assert not scheduler.schedule(req("q", 100)).placed
    cpu_only = scheduler.schedule(req("cpu", cpu=100))
    assert cpu_only.placement is not None and cpu_only.placement.node == "a"
    assert cpu_only.reasons == {"resource-fit": 2}  # b (degraded) and c (failed) were filtered out
    check_invariants(state)


def test_cpu_only_work_goes_to_healthy_nodes_only() -> None:
    state = ClusterState([node("a", 1), node("b", 1)])
    state.set_node_health("a", Health.FAILED)
    decision = _fit_only(state).schedule(req("cpu", cpu=100))
    assert decision.placement is not None and decision.placement.node == "b"


def _load(tmp_path: Path, text: str, telemetry: StaticTelemetry | None = None) -> Profile:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_profile(path, context=PluginContext(telemetry=telemetry))


def test_gpu_type_policy_allows_denies_prefers_and_reserves(tmp_path: Path) -> None:
    nodes = [node("t4", 1, model="T4"), node("a10", 1, model="A10"), node("v100", 1, model="V100M32")]
    profile = _load(
        tmp_path,
        "plugins:\n  - resource-fit\n"
        "  - {plugin: gpu-type, weight: 1, args: {deny: [T4], prefer: [A10, V100M32], reserve: [V100M32]}}\n",
    )
    state = ClusterState(nodes)
    scheduler = Scheduler(state, profile)
    assert scheduler.schedule(req("any", 1000)).placement.node == "a10"  # type: ignore[union-attr]
    assert scheduler.schedule(req("v100", 1000, models=["V100M32"])).placement.node == "v100"  # type: ignore[union-attr]
    assert not scheduler.schedule(req("t4", 500, models=["T4"])).placed


def test_telemetry_scores_and_thresholds(tmp_path: Path) -> None:
    telemetry = StaticTelemetry(
        {"a": {"gpu_utilisation": 0.9, "network_load": 0.2}, "b": {"gpu_utilisation": 0.1, "network_load": 0.95}}
    )
    telemetry.update("c", gpu_utilisation=0.5)
    text = (
        "plugins:\n  - resource-fit\n"
        "  - {plugin: telemetry, name: util, weight: 1, args: {metric: gpu_utilisation}}\n"
        "  - {plugin: telemetry, name: net, weight: 0, args: {metric: network_load, max: 0.8, missing: neutral}}\n"
    )
    state = ClusterState([node("a"), node("b"), node("c")])
    decision = Scheduler(state, _load(tmp_path, text, telemetry)).decide(req("p", 500))
    assert decision.placement is not None and decision.placement.node == "c"  # b is least busy but its NIC is hot
    assert decision.reasons == {"net": 1}
    telemetry.update("c", gpu_utilisation=0.95)
    assert Scheduler(state, _load(tmp_path, text, telemetry)).decide(req("p", 500)).placement.node == "a"  # type: ignore[union-attr]


def test_free_resource_can_pack_or_spread(tmp_path: Path) -> None:
    state = ClusterState([node("small", cpu=8000), node("big", cpu=64_000)])
    for prefer, expected in (("high", "big"), ("low", "small")):
        text = f"plugins:\n  - resource-fit\n  - {{plugin: free-resource, args: {{resource: cpu, prefer: {prefer}}}}}\n"
        assert Scheduler(state, _load(tmp_path, text)).decide(req("p", cpu=2000)).placement.node == expected  # type: ignore[union-attr]


class _Broken:
    name = "broken"

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        return [150.0 for _ in nodes]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        return identity_normalize(scores)


def test_runner_rejects_out_of_range_scores() -> None:
    state = ClusterState([node("a")])
    scheduler = Scheduler(state, Profile("bad", filters=[ResourceFit()], scorers=[WeightedScorer(_Broken(), 1.0)]))
    with pytest.raises(PluginError, match="broken.*score 150.0.*0..100"):
        scheduler.decide(req("p", 500))


def test_decision_explains_why_nothing_fits() -> None:
    state = ClusterState([node("a", 1)])
    decision = Scheduler(state, build_profile("bestfit", seed=0)).decide(req("p", 1000, 4))
    assert not decision.placed
    assert "fits nowhere" in decision.explain() and "resource-fit: 1" in decision.explain()
