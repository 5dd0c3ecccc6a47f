"""bench/revisions.py: the figures read from each bench's table, the before/after rows, their noise and flags."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "revisions.py"

SERVING_OUT = """\
  octacloud http c=1:     790 infer/s  p50   1.22 ms  p99   2.10 ms  cpu   931 us/inf (0.74 cores)  batch  1.0

medians over 1 round(s); load now 8.10 7.00 5.00
protocol  c | server     infer/s  p50 ms  p99 ms cpu us/inf cores batch | thr ratio p99 ratio cpu ratio
http      1 | octacloud      812    1.21    2.05        930  0.76   1.0 |
grpc      8 | octacloud     2650    2.90    6.10        410  1.09   6.3 |
grpc      8 | triton        2500    3.00     nan        450  1.12   6.0 |
"""

CLOUD_OUT = """\
  split  http c=1 direct :     700 infer/s  p50   1.30  p99   2.10 ms  gateway    0 replica  900 us/inf  batch  1.0

load now 9.00 8.00 7.00
layout protocol conc  direct inf/s     p50     p99  gateway inf/s     p50     p99  gw/direct  gw cpu us/inf  batch d/gw
split  http        1         700.0    1.30    2.10          560.0    1.70    3.40      0.800            410   1.0/1.0
split  grpc        8        2100.5    3.10    5.00         1800.0    4.00    7.25      0.857            380   5.9/6.1
"""

SCHEDULER_OUT = """\
filled the openb fleet to 95.0 % in 5.0 s
policy octacloud; 375 pending pods per copy; load average 2.5 1.1 1.0 at start
openb fleet ×1: 1213 nodes, 6212 GPUs, 95.0 % allocated, 375 pending
  indexed    pass    1062 ms wall     328 ms cpu; 570 decisions, 1739/s cpu, p50 0.009 ms, p99 14.640 ms, \
max 19.339 ms (cpu); placed 138, moves 0
  exhaustive pass     538 ms wall     435 ms cpu; 570 decisions, 1312/s cpu, p50 0.382 ms, p99 13.054 ms, \
max 18.094 ms (cpu)
  exhaustive / indexed: 0.5× wall, 1.3× cpu; identical placements and moves: yes; load average 2.5 1.1 1.0
openb fleet ×8: 9704 nodes, 49696 GPUs, 95.0 % allocated, 3000 pending
  indexed    pass    7885 ms wall    6020 ms cpu; 1432 decisions, 238/s cpu, p50 0.564 ms, p99 3.483 ms, \
max 21.351 ms (cpu); placed 1108, moves 2
  (no exhaustive pass above 1 copies); load average 2.5 1.1 1.0
"""


@pytest.fixture(scope="module")
def rev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_revisions", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_serving_table_gives_throughput_p99_and_cpu_per_point_and_server(rev: ModuleType) -> None:
    figures = rev.parse_serving(SERVING_OUT)
    assert figures[("http c=1 octacloud", "infer/s")] == 812
    assert figures[("http c=1 octacloud", "p99 ms")] == 2.05
    assert figures[("grpc c=8 octacloud", "cpu us/inf")] == 410
    assert figures[("grpc c=8 triton", "infer/s")] == 2500
    assert len(figures) == 9  # the per-point lines above the table are not read


def test_cloud_table_gives_the_gateways_figures_per_layout_protocol_and_concurrency(rev: ModuleType) -> None:
    figures = rev.parse_cloud(CLOUD_OUT)
    assert figures[("split http c=1", "gateway infer/s")] == 560
    assert figures[("split grpc c=8", "direct infer/s")] == 2100.5
    assert figures[("split grpc c=8", "gateway p99 ms")] == 7.25
    assert figures[("split grpc c=8", "gateway/direct")] == 0.857
    assert figures[("split http c=1", "gateway cpu us/inf")] == 410
    assert len(figures) == 10
    assert rev.parse_cloud(CLOUD_OUT.replace("\n", " \n")) == figures  # the bench pads its last column


def test_scheduler_loop_gives_pass_times_and_outcome_per_fleet(rev: ModuleType) -> None:
    figures = rev.parse_scheduler_loop(SCHEDULER_OUT)
    assert figures == {
        ("×1 (6212 GPUs)", "indexed cpu ms"): 328,
        ("×1 (6212 GPUs)", "indexed wall ms"): 1062,
        ("×1 (6212 GPUs)", "placed"): 138,
        ("×1 (6212 GPUs)", "moves"): 0,
        ("×1 (6212 GPUs)", "exhaustive cpu ms"): 435,
        ("×8 (49696 GPUs)", "indexed cpu ms"): 6020,
        ("×8 (49696 GPUs)", "indexed wall ms"): 7885,
        ("×8 (49696 GPUs)", "placed"): 1108,
        ("×8 (49696 GPUs)", "moves"): 2,
    }


def test_output_without_a_table_gives_no_figures(rev: ModuleType) -> None:
    for parse in rev.PARSERS.values():
        assert parse("Traceback (most recent call last):\n  File 'x', line 1\nValueError: bad\n") == {}


def test_runs_alternate_a_b_then_b_a(rev: ModuleType) -> None:
    assert rev.order(3) == [(0, "before"), (0, "after"), (1, "after"), (1, "before"), (2, "before"), (2, "after")]


def test_a_throughput_drop_beyond_the_rounds_spread_is_flagged_worse(rev: ModuleType) -> None:
    row = rev.compare("serving", "http c=1 octacloud", "infer/s", [1000, 1040], [900, 910])
    assert (row.before, row.after, row.before_range, row.after_range) == (1020, 905, (1000, 1040), (900, 910))
    assert row.ratio == pytest.approx(905 / 1020)
    assert row.noise == pytest.approx(40 / 1020)
    assert row.flag == "WORSE"


def test_a_change_within_the_rounds_spread_is_not_flagged(rev: ModuleType) -> None:
    row = rev.compare("serving", "http c=1 octacloud", "infer/s", [800, 1000], [850, 880])
    assert row.ratio == pytest.approx(865 / 900)
    assert row.noise == pytest.approx(200 / 900)
    assert row.flag == ""


def test_lower_latency_or_cpu_beyond_noise_is_better(rev: ModuleType) -> None:
    assert rev.compare("cloud", "split http c=1", "gateway p99 ms", [4.0, 4.1], [3.0, 3.1]).flag == "better"
    assert rev.compare("cloud", "split http c=1", "gateway cpu us/inf", [400, 404], [500, 505]).flag == "WORSE"
    assert rev.compare("cloud", "split http c=1", "gateway/direct", [0.80, 0.81], [0.90, 0.91]).flag == "better"


def test_a_single_round_has_no_noise_and_flags_nothing_timed(rev: ModuleType) -> None:
    row = rev.compare("scheduler_loop", "×1 (6212 GPUs)", "indexed cpu ms", [300], [600])
    assert row.noise is None
    assert row.flag == ""
    assert row.ratio == 2


def test_counts_that_must_not_move_are_flagged_when_they_differ(rev: ModuleType) -> None:
    assert rev.compare("scheduler_loop", "×1 (6212 GPUs)", "placed", [138], [138]).flag == ""
    assert rev.compare("scheduler_loop", "×1 (6212 GPUs)", "placed", [138, 138], [138, 137]).flag == "DIFFERS"
    assert rev.compare("scheduler_loop", "×1 (6212 GPUs)", "moves", [0, 1], [0, 1]).flag == "DIFFERS"


def test_rows_cover_every_figure_both_sides_have_and_the_table_shows_the_flags(rev: ModuleType) -> None:
    base = rev.parse_cloud(CLOUD_OUT)
    slower = {**base, ("split http c=1", "gateway infer/s"): 400.0}
    one_side = ("split grpc c=8", "direct infer/s")
    before = [{k: v for k, v in base.items() if k != one_side}] * 2  # a figure one side never had: no row
    after = [slower, {k: v for k, v in slower.items() if k != ("split grpc c=8", "gateway p99 ms")}]
    rows = rev.rows_of({"cloud": {"before": before, "after": after}})
    assert len(rows) == 9
    assert one_side not in {(r.point, r.figure) for r in rows}
    p99 = next(r for r in rows if (r.point, r.figure) == ("split grpc c=8", "gateway p99 ms"))
    assert (p99.after_range, p99.noise) == ((7.25, 7.25), None)  # left out of the round that lacked it
    flagged = [(r.point, r.figure, r.flag) for r in rows if r.flag]
    assert flagged == [("split http c=1", "gateway infer/s", "WORSE")]
    text = rev.table(rows)
    assert "0.714" in text  # 400 / 560
    assert "WORSE" in text


def test_bad_rounds_and_unknown_revisions_are_refused_naming_them(
    rev: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as rounds:
        rev.main(["--rounds", "0", "--no-record"])
    assert rounds.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no-such-revision"):
        rev.main(["--before", "no-such-revision", "--no-record"])


def test_only_this_benchs_temporary_worktrees_of_a_dead_run_are_stale(rev: ModuleType, tmp_path: Path) -> None:
    mine, gone = (tmp_path / f"octa-{side}-x1" / "octacloud" for side in ("before", "after"))
    unowned = tmp_path / "octa-before-y2" / "octacloud"
    for tree, pid in ((mine, "101"), (gone, "202"), (unowned, None)):
        tree.mkdir(parents=True)
        if pid is not None:
            (tree.parent / rev.OWNER).write_text(pid)
    porcelain = "\n".join(
        f"worktree {p}\nHEAD abc\ndetached\n" for p in (Path("/work/main"), tmp_path / "other", mine, gone, unowned)
    )
    assert rev.ours(porcelain, tmp_path) == [mine, gone, unowned]
    assert rev.stale(rev.ours(porcelain, tmp_path), alive=lambda pid: pid == 101) == [gone]


def worktrees(rev: ModuleType) -> set[Path]:
    return set(rev.ours(rev.git("worktree", "list", "--porcelain"), Path(tempfile.gettempdir())))


def made_by(tree: Path, pid: int) -> bool:
    """``tree`` is checked out, by the run ``pid``."""
    owner = tree.parent / "owner.pid"
    return owner.is_file() and owner.read_text() == str(pid) and (tree / "bench" / "scheduler_loop.py").is_file()


def test_a_bench_that_fails_names_itself_and_leaves_no_worktree(
    rev: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OCTACLOUD_TRACES", str(tmp_path / "none"))
    before = worktrees(rev)
    with pytest.raises(SystemExit, match=r"(?s)scheduler_loop at .* exited 2:.*no openb traces"):
        rev.main(["--benches", "scheduler_loop", "--rounds", "1", "--no-record"])
    assert worktrees(rev) == before


def test_worktrees_left_by_a_run_killed_with_kill_9_are_removed_by_the_next(rev: ModuleType, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    os.mkfifo(traces / "openb_node_list_gpu_node.csv")  # the bench blocks reading it: the run is in the middle
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--benches", "scheduler_loop", "--rounds", "1", "--no-record"],
        env={**os.environ, "OCTACLOUD_TRACES": str(traces)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # against a hang only
        while len(left := [t for t in worktrees(rev) if made_by(t, proc.pid)]) < 2:
            assert proc.poll() is None, "the run ended before it made both worktrees"
            assert time.monotonic() < deadline, "the run made no worktrees"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and the bench it started
        proc.wait()
    assert all(t.is_dir() for t in left)
    assert set(left) <= set(rev.remove_stale())
    assert not set(left) & worktrees(rev)
    assert not any(t.parent.exists() for t in left)
