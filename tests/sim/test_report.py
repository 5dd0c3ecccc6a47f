"""Result files in the published layout, summary.json, and the comparison with published results."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.sim.experiment import RunResult, RunSpec
from octacloud.sim.metrics import ARRIVED_PERCENTS, Curve
from octacloud.sim.report import (
    CURVE_HEADER,
    CurveRow,
    compare,
    comparison_csv,
    curve_rows,
    read_curves,
    write_curves,
    write_summary,
)


def _curve(at_100: float | None, at_130: float | None = None) -> Curve:
    values: Curve = [float(min(a, 95)) for a in ARRIVED_PERCENTS]
    values[100] = at_100
    values[130] = at_130
    values[7] = None  # a gap
    return values


def _result(policy: str, seed: int, at_100: float, failed: int = 3) -> RunResult:
    spec = RunSpec(Path("nodes.csv"), Path("openb_pod_list_default.csv"), policy, seed, 1.3)
    return RunResult(
        spec=spec,
        total_gpus=6212,
        pods=100,
        placed=100 - failed,
        failed=failed,
        failed_by_shape={"1x1000": failed},
        alloc_curve=_curve(at_100, 90.0),
        frag_curve=_curve(1.5),
        final_frag_rate=12.345,
        decisions_per_second=1234.5,
        p50_decision_ms=0.5,
        p99_decision_ms=2.0,
        wall_seconds=9.0,
        cpu_seconds=8.5,
    )


def test_alloc_csv_has_the_published_header_and_rows_parse_back(tmp_path: Path) -> None:
    results = [_result("fgd", 42, 95.25), _result("bestfit", 42, 93.0), _result("octacloud", 43, 96.0)]
    path = tmp_path / "alloc.csv"
    write_curves(path, curve_rows(results, "alloc"))
    with path.open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CURVE_HEADER)
    assert rows[0][:6] == ["workload", "sc_policy", "tune", "seed", "total_gpus", "0"] and rows[0][-1] == "130"
    assert rows[1][:5] == ["openb_pod_list_default", "06-FGD", "1.3", "42", "6212"]
    assert rows[2][1] == "05-BestFit" and rows[3][1] == "octacloud"
    assert rows[1][5 + 7] == ""  # the gap stays empty
    back = read_curves(path)
    assert [r.at(100) for r in back] == [95.25, 93.0, 96.0]
    assert back[0].values == results[0].alloc_curve


def test_reads_the_published_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "published.csv"
    header = ",".join(CURVE_HEADER)
    values = ",".join("50.5" if a == 100 else "" for a in ARRIVED_PERCENTS)
    path.write_text(f"{header}\nopenb_pod_list_default,06-FGD,1.3,42,6212,{values}\n")
    (row,) = read_curves(path)
    assert row == CurveRow("openb_pod_list_default", "06-FGD", "1.3", 42, 6212, [*[None] * 100, 50.5, *[None] * 30])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("workload,sc_policy,tune,seed\n", "missing column\\(s\\) total_gpus"),
        ("workload,sc_policy,tune,seed,total_gpus,100\nw,p,1.3,x,6212,1\n", "line 2: column 'seed': 'x'"),
        ("workload,sc_policy,tune,seed,total_gpus,100\nw,p,1.3,1,6212,abc\n", "line 2: column '100': 'abc'"),
        ("workload,sc_policy,tune,seed,total_gpus,100\nw,p,1.3,1,6212\n", "line 2: 5 fields, the header has 6"),
    ],
)
def test_malformed_curve_files_name_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(InvalidSpecError, match=message):
        read_curves(path)


def test_missing_curve_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="no such file"):
        read_curves(tmp_path / "nope.csv")


def test_summary_json_has_every_run_and_the_aggregates(tmp_path: Path) -> None:
    results = [_result("fgd", 42, 95.0), _result("fgd", 43, 94.0, failed=5)]
    path = tmp_path / "summary.json"
    write_summary(path, results)
    doc = json.loads(path.read_text())
    run = doc["runs"][0]
    for key in (
        "workload", "policy", "sc_policy", "seed", "tune", "pods", "placed", "failed", "failed_by_shape",
        "unallocated_gpu_pct_at_100", "unallocated_gpu_pct_at_130", "decisions_per_second", "p99_decision_ms",
    ):  # fmt: skip
        assert key in run
    assert run["unallocated_gpu_pct_at_100"] == 5.0 and run["unallocated_gpu_pct_at_130"] == 10.0
    (agg,) = doc["aggregate"]
    assert agg["sc_policy"] == "06-FGD" and agg["seeds"] == [42, 43]
    assert agg["unallocated_gpu_pct_at_100"] == {"mean": 5.5, "sd": pytest.approx(0.71, abs=0.01)}
    assert agg["failed_pods_mean"] == 4.0 and agg["cpu_seconds_mean"] == 8.5


def _rows(workload: str, policy: str, at_100: list[float | None]) -> list[CurveRow]:
    rows = []
    for seed, value in enumerate(at_100, start=42):
        values: Curve = [None] * len(ARRIVED_PERCENTS)
        values[100] = value
        rows.append(CurveRow(workload, policy, "1.3", seed, 6212, values))
    return rows


def test_compare_against_a_small_published_file() -> None:
    published = [
        *_rows("default", "06-FGD", [95.0, 95.4, 95.2]),  # unallocated 5.0, 4.6, 4.8 → 4.8 ± 0.2
        *_rows("default", "05-BestFit", [93.0, 92.0]),
        *_rows("gpushare40", "06-FGD", [90.0]),  # a workload we did not run: left out
    ]
    ours = [
        *_rows("default", "06-FGD", [95.0, 94.0]),  # 5.0, 6.0 → 5.5 ± 0.71
        *_rows("default", "octacloud", [96.5]),  # never published
        *_rows("default", "05-BestFit", [None, 92.5]),  # one gap: counted out
    ]
    table = compare(ours, published)
    assert [(r.workload, r.sc_policy) for r in table] == [
        ("default", "05-BestFit"),
        ("default", "06-FGD"),
        ("default", "octacloud"),
    ]
    bestfit, fgd, ours_only = table
    assert (fgd.published_mean, fgd.published_sd, fgd.published_n) == (4.8, 0.2, 3)
    assert (fgd.ours_mean, fgd.ours_sd, fgd.ours_n) == (5.5, 0.71, 2)
    assert fgd.difference == 0.7 and fgd.within(0.5) is False and fgd.within(1.0) is True
    assert (bestfit.ours_mean, bestfit.ours_n, bestfit.published_mean, bestfit.difference) == (7.5, 1, 7.5, 0.0)
    assert ours_only.published_mean is None and ours_only.difference is None and ours_only.within(0.5) is None
    text = comparison_csv(table)
    lines = text.splitlines()
    assert lines[0].startswith("workload,sc_policy,published_mean") and len(lines) == 4
    assert lines[3].startswith("default,octacloud,,,0,3.5,0.0,1,")


def test_compare_rejects_an_arrived_percent_outside_the_curve() -> None:
    with pytest.raises(InvalidSpecError, match="--at must be within 0..130"):
        compare([], [], at=131)
