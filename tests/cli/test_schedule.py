"""``octacloud schedule``: places a trace in file order and prints a summary; bad inputs give clear errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app

runner = CliRunner(env={"COLUMNS": "200"})


def test_schedule_prints_the_summary(small_trace: tuple[Path, Path]) -> None:
    nodes, pods = small_trace
    result = runner.invoke(app, ["schedule", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd"])
    assert result.exit_code == 0, result.output
    out = result.output
    for label in ("pods", "placed", "failed", "allocated milli-GPU", "allocated GPU %", "decisions/s"):
        assert label in out
    # 8 pods asking 5,960 milli on 7,000: everything fits in file order.
    assert "5960 / 7000" in out and "85.14" in out


def test_schedule_reports_failures_by_shape(tmp_path: Path, small_trace: tuple[Path, Path]) -> None:
    nodes, _ = small_trace
    pods = tmp_path / "big.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1,8,1000\np1,1000,1,1,1000\n")
    result = runner.invoke(app, ["schedule", "--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit"])
    assert result.exit_code == 0, result.output
    assert "failed 8x1000" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pods", "{pods}", "--nodes", "{missing}"], "cannot read the trace file"),
        (["--pods", "{pods}", "--nodes", "{nodes}", "--policy", "fastest"], "unknown policy 'fastest'"),
        (["--pods", "{bad}", "--nodes", "{nodes}"], "line 2, column 'num_gpu'"),
    ],
)
def test_bad_inputs_are_clear_errors(
    tmp_path: Path, small_trace: tuple[Path, Path], args: list[str], message: str
) -> None:
    nodes, pods = small_trace
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1,two,1000\n")
    paths = {"nodes": nodes, "pods": pods, "missing": tmp_path / "missing.csv", "bad": bad}
    result = runner.invoke(app, ["schedule", *(a.format(**paths) for a in args)])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.traces
def test_schedule_on_the_openb_fleet(tmp_path: Path, openb: Path) -> None:
    with (openb / "openb_pod_list_default.csv").open() as f:
        head = "".join(itertools.islice(f, 301))  # header + 300 pods
    pods = tmp_path / "openb_300.csv"
    pods.write_text(head)
    nodes = openb / "openb_node_list_gpu_node.csv"
    result = runner.invoke(app, ["schedule", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd"])
    assert result.exit_code == 0, result.output
    assert "1213 / 6212" in result.output
