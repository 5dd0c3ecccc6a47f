"""Profiles from YAML/TOML: built-ins load, and every user mistake is an error naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core import InvalidSpecError
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.plugins import REGISTRY
from octacloud.scheduler.plugins.fgd import FragmentationGradient
from octacloud.scheduler.plugins.free_resource import FreeResource
from octacloud.scheduler.plugins.octant import OctantUnit
from octacloud.scheduler.policies import POLICY_IDS, build_profile, policy_names
from octacloud.scheduler.profiles import load_profile
from octacloud.scheduler.registry import PluginContext
from octacloud.scheduler.telemetry import StaticTelemetry
from tests.scheduler.helpers import node, req

WORKLOAD = TargetWorkload((WorkloadShape(1000, 500, 1),), (1.0,))


def test_policy_ids_are_the_published_ones() -> None:
    assert POLICY_IDS["fgd"] == "06-FGD" and POLICY_IDS["random"] == "01-Random"
    assert policy_names()[:6] == list(POLICY_IDS)
    assert {"spread", "octacloud", "cpu-idle-sketch", "multi-objective"} <= set(policy_names())


@pytest.mark.parametrize(
    "name", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "spread", "octacloud"]
)
def test_builtin_profiles_build_and_schedule(name: str) -> None:
    profile = build_profile(name, seed=1, workload=WORKLOAD)
    assert profile.name == name and profile.seed == 1
    state = ClusterState([node("a"), node("b")])
    assert Scheduler(state, profile).schedule(req("p", 500)).placed


def test_published_profiles_have_no_product_rules_unless_asked() -> None:
    plain = build_profile("fgd", seed=0, workload=WORKLOAD)
    assert not plain.rewriters and not plain.pre_filters
    ruled = build_profile("fgd", seed=0, workload=WORKLOAD, rules=True)
    assert any(isinstance(p, OctantUnit) for p in ruled.rewriters)
    assert {p.name for p in ruled.pre_filters} == {"failover-headroom", "model-memory", "replica-spread"}
    assert ruled.filters[-1].name == "replica-spread"  # last: it keeps the best of what the others left
    product = build_profile("octacloud", seed=0, workload=WORKLOAD)  # rules=False: trace comparability
    assert not product.rewriters


def test_the_design_sketch_weighs_cpu_idle_and_free_memory() -> None:
    profile = build_profile("cpu-idle-sketch", seed=0, telemetry=StaticTelemetry({"a": {"network_load": 0.9}}))
    weights = {ws.plugin.name: ws.weight for ws in profile.scorers}
    assert weights == {"cpu-idle": 0.7, "free-memory": 0.3}
    assert all(isinstance(ws.plugin, FreeResource) for ws in profile.scorers)
    state = ClusterState([node("a", cpu=64_000), node("b", cpu=32_000), node("c", cpu=64_000, memory=1024 * 64)])
    decision = Scheduler(state, profile).schedule(req("p", 500))
    # b: 0.7 × 96.9 + 0.3 × 99.6 = 97.7; c: 0.7 × 98.4 + 0.3 × 98.4 = 98.4
    assert decision.placement is not None and decision.placement.node == "c"
    assert decision.reasons.get("network-load") == 1  # "a" is over the network-load threshold


def test_twelve_factor_profile_is_configuration() -> None:
    profile = build_profile("multi-objective", seed=0, workload=WORKLOAD, telemetry=StaticTelemetry(), rules=True)
    assert len(profile.scorers) == 12
    assert any(isinstance(ws.plugin, FragmentationGradient) for ws in profile.scorers)


def test_toml_and_yaml_load_alike(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(
        'name = "t"\n[[plugins]]\nplugin = "resource-fit"\n[[plugins]]\nplugin = "spread"\nweight = 2\n'
    )
    (tmp_path / "p.yaml").write_text("name: t\nplugins:\n  - resource-fit\n  - {plugin: spread, weight: 2}\n")
    a, b = load_profile(tmp_path / "p.toml"), load_profile(tmp_path / "p.yaml")
    assert [ws.weight for ws in a.scorers] == [ws.weight for ws in b.scorers] == [2.0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plugins: [resource-fit]\nwieght: 1\n", r"p.yaml: unknown key\(s\) \['wieght'\]"),
        ("plugins: [nonesuch]\n", r"p.yaml: plugins\[0\].plugin: unknown plugin 'nonesuch'"),
        ("plugins:\n  - {plugin: spread, weight: -1}\n", r"plugins\[0\].weight: expected a finite number >= 0"),
        ("plugins:\n  - {plugin: spread, weight: fast}\n", r"plugins\[0\].weight"),
        ("plugins:\n  - {plugin: resource-fit, weight: 1}\n", "does not score nodes"),
        ("plugins:\n  - {plugin: spread, colour: red}\n", r"plugins\[0\]: unknown key\(s\) \['colour'\]"),
        ("plugins:\n  - {plugin: model-memory, args: {percent: 120}}\n", r"plugins\[0\].args.percent: must be <= 100"),
        ("plugins:\n  - {plugin: model-memory, args: {pct: 50}}\n", r"args: unknown key\(s\) \['pct'\]"),
        ("plugins:\n  - {plugin: free-resource, args: {resource: disk}}\n", "must be one of"),
        ("plugins:\n  - {plugin: free-resource}\n", "args.resource: is required"),
        ("plugins: [spread, spread]\n", "'spread' is used twice"),
        ("plugins: []\n", "non-empty list"),
        ("plugins:\n  - fgd\n", "needs a target workload"),
        ("plugins:\n  - {plugin: telemetry, args: {metric: x}}\n", "needs a telemetry source"),
        ("- just a list\n", "must be a mapping"),
        ("plugins: [\n", "not valid YAML"),
    ],
)
def test_profile_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(InvalidSpecError, match=message) as info:
        load_profile(path)
    assert "p.yaml" in str(info.value)


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(InvalidSpecError, match=r"\.yaml, \.yml or \.toml"):
        load_profile(tmp_path / "p.json")
    with pytest.raises(InvalidSpecError, match="cannot read the profile"):
        load_profile(tmp_path / "absent.yaml")
    with pytest.raises(InvalidSpecError, match="no built-in profile 'nope'"):
        build_profile("nope", seed=0)


def test_registry_lists_every_kind_with_a_summary() -> None:
    kinds = REGISTRY.kinds()
    assert {"fgd", "resource-fit", "telemetry", "octant-unit"} <= {k.name for k in kinds}
    assert all(k.summary for k in kinds)
    assert "fgd" in REGISTRY
    with pytest.raises(ValueError, match="already registered"):
        REGISTRY.register("fgd", lambda name, args, ctx: FragmentationGradient(WORKLOAD))
    assert PluginContext().seed == 0
