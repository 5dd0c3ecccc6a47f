"""``octacloud simulate`` and ``simulate compare`` through the CLI: files written, tables, bad inputs."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.sim.metrics import ARRIVED_PERCENTS
from octacloud.sim.report import CURVE_HEADER

runner = CliRunner(env={"COLUMNS": "200"})


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_simulate_writes_the_published_files_and_figures(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    out = tmp_path / "out"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "random,fgd"]
    result = runner.invoke(app, [*args, "--seeds", "42-43", "--out", str(out)])
    assert result.exit_code == 0, result.output
    with (out / "alloc.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CURVE_HEADER)
    assert [(r[0], r[1], r[2], r[3]) for r in rows[1:]] == [
        ("small_pods", "01-Random", "1.3", "42"),
        ("small_pods", "01-Random", "1.3", "43"),
        ("small_pods", "06-FGD", "1.3", "42"),
        ("small_pods", "06-FGD", "1.3", "43"),
    ]
    assert (out / "frag.csv").read_text().splitlines()[0] == ",".join(CURVE_HEADER)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 4 and len(summary["aggregate"]) == 2
    assert {p.name for p in out.glob("*.png")} == {"unallocated_small_pods.png", "unallocated_at_100.png"}
    assert "unallocated GPU %" in result.output and "small_pods" in result.output
    assert "[4/4] small_pods" in result.output  # not a terminal: one progress line per finished run


def test_compare_on_our_own_results(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    out = tmp_path / "out"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit", "--out", str(out)]
    assert runner.invoke(app, [*args, "--no-plots"]).exit_code == 0
    assert not list(out.glob("*.png"))
    published = tmp_path / "published.csv"
    header = ",".join(CURVE_HEADER)
    values = ",".join("90.0" for _ in ARRIVED_PERCENTS)
    published.write_text(
        f"{header}\nsmall_pods,05-BestFit,1.3,42,7,{values}\nsmall_pods,05-BestFit,1.3,43,7,{values}\n"
    )
    table = runner.invoke(app, ["simulate", "compare", str(out), "--published", str(published)])
    assert table.exit_code == 0, table.output
    assert "05-BestFit" in table.output and "10.00 ± 0.00 (n=2)" in _flat(table.output)
    as_json = runner.invoke(app, ["simulate", "compare", str(out), "--published", str(published), "--format", "json"])
    (row,) = json.loads(as_json.output)
    assert row["published_mean"] == 10.0 and row["ours_n"] == 1
    assert row["difference"] == round(row["ours_mean"] - 10.0, 2)
    as_csv = runner.invoke(app, ["simulate", "compare", str(out), "--published", str(published), "--format", "csv"])
    assert as_csv.output.splitlines()[0].startswith("workload,sc_policy,published_mean")


def test_churn_mode(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    out = tmp_path / "churn"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd", "--out", str(out)]
    churn = ["--arrivals", "poisson:0.05", "--lifetime", "exponential:100", "--duration", "3600", "--queue"]
    result = runner.invoke(app, [*args, *churn])
    assert result.exit_code == 0, result.output
    (run,) = json.loads((out / "churn.json").read_text())["runs"]
    assert run["queue"] is True and 0 < run["time_avg_allocated_gpu_pct"] < 100
    assert run["reevaluations"] == 720 and run["lifetime_spec"] == "exponential:100"
    assert run["reservations"] == 1  # the loop's queue discipline, the default
    assert (out / "churn_small_pods.png").is_file()
    assert "time-averaged GPU allocation" in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seeds", "51-42"], "range '51-42' must be non-negative and ascending"),
        (["--seeds", "x"], "'x' is not a seed"),
        (["--policy", "fgd,fastest"], "unknown policy 'fastest'"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--tune", "0"], "--tune must be in (0, 10]"),
        (["--arrivals", "poisson"], "expected poisson:RATE"),
        (["--arrivals", "poisson:1", "--lifetime", "lognormal:1"], "expected 2 number(s)"),
        (["--arrivals", "poisson:1", "--queue", "--reservations", "-1"], "--reservations must be >= 0"),
    ],
)
def test_bad_options_are_clear_errors(
    tmp_path: Path, small_trace: tuple[Path, Path], extra: list[str], message: str
) -> None:
    nodes, pods = small_trace
    out = tmp_path / "out"
    result = runner.invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--out", str(out), *extra])
    assert result.exit_code == 2
    assert message in _flat(result.output)
    assert not out.exists()  # nothing half-written


def test_missing_files_and_folders(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    missing = tmp_path / "missing.csv"
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\np1,1,1,1,half\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    cases = [
        (["simulate", "--nodes", str(missing), "--pods", str(pods), "--out", str(tmp_path)], "no such file"),
        (["simulate", "--nodes", str(nodes), "--out", str(tmp_path)], "--pods is required"),
        (["simulate", "--nodes", str(nodes), "--pods", str(pods)], "--out is required"),
        (["simulate", "--nodes", str(nodes), "--pods", str(bad), "--out", str(tmp_path)], "line 3, column 'gpu_milli'"),
        (["simulate", "--nodes", str(nodes), "--pods", str(empty), "--out", str(tmp_path)], "the trace has no pods"),
        (["simulate", "compare", str(tmp_path / "none"), "--published", str(missing)], "no such folder"),
        (["simulate", "compare", str(tmp_path), "--published", str(missing)], "no alloc.csv here"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in _flat(result.output), (args, result.output)


@pytest.mark.traces
def test_simulate_on_a_slice_of_the_openb_trace(tmp_path: Path, openb: Path) -> None:
    with (openb / "openb_pod_list_default.csv").open() as f:
        head = "".join(itertools.islice(f, 401))  # header + 400 pods, inflated to 1.3 × the fleet
    pods = tmp_path / "openb_pod_list_default.csv"
    pods.write_text(head)
    nodes = openb / "openb_node_list_gpu_node.csv"
    out = tmp_path / "out"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit", "--seeds", "42"]
    result = runner.invoke(app, [*args, "--tune", "0.1", "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    published = runner.invoke(
        app, ["simulate", "compare", str(out), "--published", str(openb / "fgd_published_alloc.csv"), "--at", "10"]
    )
    assert published.exit_code == 0, published.output
    assert "05-BestFit" in published.output and "(n=10)" in published.output
