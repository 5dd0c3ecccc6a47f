"""The seeded generators: workload families (restricted shares, CPU ratios), fleets, samples, the suite, the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Node, Request
from octacloud.sim.generate import (
    SUITE_FAMILIES,
    SUITE_FLEETS,
    WorkloadSpec,
    generate_fleet,
    parse_mix,
    parse_workload_spec,
    restrict_workload,
    sample_fleet,
    write_nodes,
    write_pods,
    write_suite,
)
from octacloud.sim.traces import read_nodes, read_pods


def _node(name: str, model: str, cards: int, cpu: int = 64_000, memory: int = 262_144) -> Node:
    return Node(name, cpu, memory, tuple(Gpu(g, model, 16_384) for g in range(cards)))


FLEET = [_node(f"g{i}", "G2", 8, 96_000) for i in range(6)] + [_node(f"t{i}", "T4", 2, 16_000) for i in range(4)]
PODS = [Request(f"p{i}", num_gpu=1, gpu_milli=1000, cpu_milli=4000, memory_mib=8192) for i in range(40)] + [
    Request(f"m{i}", num_gpu=8, gpu_milli=1000, cpu_milli=64_000, memory_mib=65_536) for i in range(5)
]


def test_spec_parsing_and_its_errors() -> None:
    spec = parse_workload_spec("0.1@T4, 0.05@V100M16|V100M32,cpu=1.5,mem=0.5")
    assert spec.restrict == ((0.1, frozenset({"T4"})), (0.05, frozenset({"V100M16", "V100M32"})))
    assert (spec.cpu_scale, spec.memory_scale) == (1.5, 0.5)
    assert str(spec) == "0.1@T4,0.05@V100M16|V100M32,cpu=1.5,mem=0.5"
    assert parse_workload_spec("none") == WorkloadSpec()
    for bad, message in (
        ("0.1T4", "not SHARE@MODELS"),
        ("1.5@T4", "share in"),
        ("0.1@", "at least one model"),
        ("gpu=2", "unknown key"),
        ("cpu=0", "scale must be in"),
        ("0.7@T4,0.6@G2", "more than 1"),
        ("x@T4", "not a number"),
        ("0.1@T4,,cpu=2", "empty item"),
    ):
        with pytest.raises(InvalidSpecError, match=message):
            parse_workload_spec(bad)


def test_restriction_takes_the_share_only_from_pods_that_fit_the_models() -> None:
    spec = parse_workload_spec("0.2@T4")
    family, description = restrict_workload(PODS, FLEET, spec, seed=3)
    restricted = [p for p in family if p.gpu_models]
    assert all(p.gpu_models == {"T4"} and p.num_gpu == 1 for p in restricted)  # 8-card pods cannot use T4
    total = sum(p.total_gpu_milli for p in PODS)
    assert sum(p.total_gpu_milli for p in restricted) <= 0.2 * total
    assert sum(p.total_gpu_milli for p in restricted) >= 0.2 * total - 1000  # within one pod of the share
    assert description["restricted_share"] == pytest.approx(
        sum(p.total_gpu_milli for p in restricted) / total, abs=1e-4
    )
    (entry,) = description["sets"]  # type: ignore[misc]
    assert entry["capacity_share"] == pytest.approx(8 / 56, abs=1e-4)
    assert [p.name for p in family] == [p.name for p in PODS]
    assert restrict_workload(PODS, FLEET, spec, seed=3)[0] == family  # seeded
    assert restrict_workload(PODS, FLEET, spec, seed=4)[0] != family
    with pytest.raises(InvalidSpecError, match="no node of A100"):
        restrict_workload(PODS, FLEET, parse_workload_spec("0.1@A100"), seed=1)


def test_cpu_scale_changes_the_ratio_but_keeps_pods_placeable() -> None:
    family, _ = restrict_workload(PODS, FLEET, parse_workload_spec("cpu=2"), seed=1)
    assert {p.cpu_milli for p in family if p.num_gpu == 1} == {8000}
    assert {p.cpu_milli for p in family if p.num_gpu == 8} == {96_000}  # capped at the largest 8-card node
    cpu_only = Request("c", cpu_milli=3000)
    assert restrict_workload([*PODS, cpu_only], FLEET, parse_workload_spec("cpu=2"), seed=1)[0][-1] == cpu_only


def test_generated_fleet_has_the_mix_and_is_readable(tmp_path: Path) -> None:
    rows = generate_fleet(
        20, parse_mix("A100-80G:3,H800:1,GPU-series-1:1"), gpu_memory_gib={"GPU-series-1": 64}, seed=5
    )
    counts = Counter(r[4] for r in rows)
    assert counts == {"A100-80G": 12, "H800": 4, "GPU-series-1": 4}
    path = tmp_path / "fleet.csv"
    write_nodes(path, rows)
    nodes = read_nodes(path)  # the gpu_memory_mib column makes any model readable
    by_model = {n.gpu_model: n.gpus[0].memory_mib for n in nodes}
    assert by_model == {"A100-80G": 81_920, "H800": 81_920, "GPU-series-1": 65_536}
    assert all(n.gpu_count == 8 for n in nodes)
    assert generate_fleet(20, parse_mix("A100-80G:3,H800:1"), seed=5) == generate_fleet(
        20, parse_mix("A100-80G:3,H800:1"), seed=5
    )
    with pytest.raises(InvalidSpecError, match="no card memory for \\['X'\\]"):
        generate_fleet(2, parse_mix("X"), seed=1)
    with pytest.raises(InvalidSpecError, match="a model appears twice"):
        parse_mix("A10:1,A10:2")


def test_sample_keeps_every_node_kind_and_cpu_only_nodes(tmp_path: Path) -> None:
    nodes = [*FLEET, *(Node(f"c{i}", 32_000, 65_536) for i in range(8))]
    rows = sample_fleet(nodes, 0.5, seed=2)
    kinds = Counter((r[4], r[3]) for r in rows)
    assert kinds == {("G2", 8): 3, ("T4", 2): 2, ("", 0): 4}
    path = tmp_path / "sample.csv"
    write_nodes(path, rows)
    assert sum(n.gpu_count == 0 for n in read_nodes(path)) == 4
    with pytest.raises(InvalidSpecError, match="fraction"):
        sample_fleet(nodes, 0.0, seed=1)


def test_written_pods_read_back(tmp_path: Path) -> None:
    family, _ = restrict_workload(PODS, FLEET, parse_workload_spec("0.1@T4|G2"), seed=1)
    path = tmp_path / "pods.csv"
    write_pods(path, family)
    assert [p.request for p in read_pods(path)] == family


@pytest.mark.traces
def test_the_suite_on_openb(tmp_path: Path, openb: Path) -> None:
    entries = write_suite(openb, tmp_path, only=("q-t4-10", "h-mix-30"))
    assert [e["family"] for e in entries] == ["q-t4-10", "h-mix-30"]
    assert len(SUITE_FAMILIES) >= 20 and len({f.fleet for f in SUITE_FAMILIES}) >= 3
    for fleet in SUITE_FLEETS:
        assert read_nodes(tmp_path / f"fleet_{fleet.name}.csv")
    for entry in entries:
        asked = parse_workload_spec(SUITE_FAMILIES_BY_NAME[str(entry["family"])]).restricted_share
        assert abs(float(str(entry["restricted_share"])) - asked) < 0.01
    described = json.loads((tmp_path / "suite.json").read_text())
    assert described == entries


SUITE_FAMILIES_BY_NAME = {f.name: f.spec for f in SUITE_FAMILIES}


def test_cli_generate_and_compare_print_the_bound(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    _, pods = small_trace
    runner = CliRunner()
    fleet = tmp_path / "fleet.csv"
    result = runner.invoke(
        app,
        [
            "simulate",
            "generate",
            "fleet",
            "--count",
            "3",
            "--gpus",
            "2",
            "--mix",
            "L40:1,GPU-series-1:2",
            "--card-gib",
            "GPU-series-1=32",
            "--cpu",
            "32",
            "--memory-gib",
            "128",
            "--out",
            str(fleet),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "3 nodes, 6 GPUs" in result.output
    family = tmp_path / "fam.csv"
    result = runner.invoke(
        app,
        [
            "simulate",
            "generate",
            "workload",
            "--pods",
            str(pods),
            "--nodes",
            str(fleet),
            "--spec",
            "0.2@L40",
            "--out",
            str(family),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["sets"][0]["models"] == "L40"
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--nodes",
            str(fleet),
            "--pods",
            str(family),
            "--policy",
            "fgd,octacloud",
            "--seeds",
            "1-2",
            "--out",
            str(out),
            "--no-plots",
        ],
    )
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "summary.json").read_text())["runs"]
    bounds = [r["lower_bound_unallocated_pct_at_100"] for r in runs]
    assert all(isinstance(b, float) for b in bounds)
    assert all(b <= r["unallocated_gpu_pct_at_100"] + 1e-9 for b, r in zip(bounds, runs, strict=True))
    table = runner.invoke(app, ["simulate", "compare", str(out), "--format", "json"])
    assert table.exit_code == 0, table.output
    rows = json.loads(table.output)
    assert {r["sc_policy"] for r in rows} == {"06-FGD", "octacloud"}
    assert all(r["bound_n"] == 2 and r["published_mean"] is None for r in rows)
    text = runner.invoke(app, ["simulate", "compare", str(out)])
    assert "LP bound" in text.output and "8-card failed" in text.output
    bad = runner.invoke(
        app,
        [
            "simulate",
            "generate",
            "workload",
            "--pods",
            str(pods),
            "--nodes",
            str(fleet),
            "--spec",
            "0.2@H800",
            "--out",
            str(family),
        ],
    )
    assert bad.exit_code == 2 and "no node of H800" in bad.output
