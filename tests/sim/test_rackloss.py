"""Losing a rack in the simulator: the seeded rack generator, the rack-loss run and its CLI, on small fleets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.core import Gpu, InvalidSpecError, Node
from octacloud.core.domains import domains_of, group_by_domain
from octacloud.sim.domains import DomainSpec, assign_domains, describe, parse_domain_spec
from octacloud.sim.rackloss import RackLossSpec, run_rack_loss
from octacloud.sim.traces import read_nodes

runner = CliRunner(env={"COLUMNS": "200"})


def _fleet(eights: int, twos: int) -> list[Node]:
    big = [Node(f"b{k}", 96_000, 786_432, tuple(Gpu(g, "V100M32", 32_768) for g in range(8))) for k in range(eights)]
    small = [Node(f"s{k}", 32_000, 131_072, tuple(Gpu(g, "T4", 16_384) for g in range(2))) for k in range(twos)]
    return big + small


def test_racks_hold_one_kind_of_server_within_their_slots_and_the_seed_decides() -> None:
    nodes = _fleet(10, 40)
    spec = DomainSpec(rack_gpus=32, rack_nodes=16, feed_racks=2, zones=3)
    a = assign_domains(nodes, spec, seed=1)
    racks = group_by_domain(a, "rack")
    for members in racks.values():
        assert len({(a[i].gpu_model, a[i].gpu_count) for i in members}) == 1
        assert sum(a[i].gpu_count for i in members) <= 32 and len(members) <= 16
    assert describe(a)["racks"] == len(racks) == 3 + 3  # 10 eight-card nodes in racks of 4, 40 two-card in 16s
    feeds = {domains_of(n).power_feed for n in a}
    assert len(feeds) == 3 and {domains_of(n).zone for n in a} == {"z0", "z1", "z2"}
    assert assign_domains(nodes, spec, seed=1) == a  # a pure function of its inputs and seed
    assert [domains_of(n).rack for n in assign_domains(nodes, spec, seed=2)] != [domains_of(n).rack for n in a]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rack_gpus=0", "rack_gpus must be a whole number >= 1"),
        ("racks=3", "is not KEY=N with KEY one of"),
        ("zones=2,zones=3", "zones is given twice"),
        ("zones=two", "zones='two' is not a whole number"),
    ],
)
def test_bad_rack_specs_are_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_domain_spec(text)


PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(
    f"p{k},{1000 + 500 * (k % 3)},{2048},{2 if k % 4 == 3 else 1},{(250, 500, 1000, 1000)[k % 4]}\n" for k in range(60)
)


def _files(tmp_path: Path) -> tuple[Path, Path]:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{k},32000,131072,2,T4\n" for k in range(12)))
    pods = tmp_path / "pods.csv"
    pods.write_text(PODS)
    return nodes, pods


def test_domain_aware_re_places_a_lost_rack_where_plain_packing_cannot(tmp_path: Path) -> None:
    nodes, pods = _files(tmp_path)
    racks = DomainSpec(rack_gpus=4, rack_nodes=2, feed_racks=2, zones=1)
    plain, aware = (run_rack_loss(RackLossSpec(nodes, pods, p, 42, racks)) for p in ("octacloud", "domain-aware"))
    assert plain.racks == aware.racks == 6
    assert plain.allocation > 0.9 and plain.unplaced_share > 0.5  # a full fleet has nowhere to put a rack
    assert aware.unplaced_share == 0.0 and aware.uncovered_racks == 0
    assert plain.allocation - aware.allocation <= 1 / 6 + 1e-9  # at most one rack's worth kept free


def test_the_cli_prints_the_table_and_writes_the_runs(tmp_path: Path) -> None:
    nodes, pods = _files(tmp_path)
    out = tmp_path / "out"
    args = ["simulate", "rack-loss", "--nodes", str(nodes), "--pods", str(pods), "--out", str(out)]
    result = runner.invoke(app, [*args, "--policy", "octacloud,domain-aware", "--racks", "rack_gpus=4,zones=1"])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "rackloss.json").read_text())
    assert [r["policy"] for r in rows] == ["octacloud", "domain-aware"]
    aware = next(line for line in result.output.splitlines() if "domain-aware" in line)
    assert f"{rows[1]['allocation_pct'] - rows[0]['allocation_pct']:+.2f}" in aware and "0.00" in aware
    bad = runner.invoke(app, [*args, "--racks", "rack_gpus=none"])
    assert bad.exit_code != 0 and "rack_gpus='none' is not a whole number" in bad.output


def test_generate_racks_writes_a_node_file_the_reader_takes_back(tmp_path: Path) -> None:
    nodes, _ = _files(tmp_path)
    out = tmp_path / "racked.csv"
    args = ["simulate", "generate", "racks", "--nodes", str(nodes), "--seed", "3", "--out", str(out)]
    result = runner.invoke(app, [*args, "--racks", "rack_gpus=4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["racks"] == 6
    back = read_nodes(out)
    assert back == assign_domains(read_nodes(nodes), DomainSpec(rack_gpus=4), seed=3)
