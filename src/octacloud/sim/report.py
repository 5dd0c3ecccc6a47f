"""Result files of ``octacloud simulate`` and the comparison with the published results.

* ``alloc.csv`` / ``frag.csv``: the published layout ``workload,sc_policy,tune,seed,total_gpus,0,1,...,130``,
  one row per run (allocation ratio %, resp. fragmentation amount as % of capacity, at each arrived %).
* ``summary.json``: one entry per run (see :meth:`RunResult.summary`) and per workload and policy the mean
  and standard deviation over seeds.

:func:`compare` lines our rows up with the published ones per workload and policy at one arrived %.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from octacloud.core.errors import InvalidSpecError
from octacloud.sim.experiment import RunResult
from octacloud.sim.metrics import ARRIVED_PERCENTS, Curve

META_COLUMNS: tuple[str, ...] = ("workload", "sc_policy", "tune", "seed", "total_gpus")
CURVE_HEADER: tuple[str, ...] = (*META_COLUMNS, *(str(a) for a in ARRIVED_PERCENTS))
COMPARISON_COLUMNS: tuple[str, ...] = (
    "workload",
    "sc_policy",
    "published_mean",
    "published_sd",
    "published_n",
    "ours_mean",
    "ours_sd",
    "ours_n",
    "difference",
    "bound_mean",
    "bound_sd",
    "bound_n",
    "failed_8gpu_mean",
)


@dataclass(frozen=True, slots=True)
class CurveRow:
    """One row of an ``alloc.csv``/``frag.csv`` file."""

    workload: str
    sc_policy: str
    tune: str
    seed: int
    total_gpus: int
    values: Curve

    def at(self, arrived_percent: int) -> float | None:
        return self.values[arrived_percent] if 0 <= arrived_percent < len(self.values) else None


def curve_rows(results: Iterable[RunResult], which: str) -> list[CurveRow]:
    """``which`` = ``alloc`` or ``frag``: the results as rows of the published files."""
    if which not in ("alloc", "frag"):
        raise ValueError(f"which must be 'alloc' or 'frag', got {which!r}")
    return [
        CurveRow(
            r.spec.workload,
            r.spec.sc_policy,
            _format_tune(r.spec.tune),
            r.spec.seed,
            r.total_gpus,
            r.alloc_curve if which == "alloc" else r.frag_curve,
        )
        for r in results
    ]


def write_curves(path: Path, rows: Iterable[CurveRow]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CURVE_HEADER)
        for row in rows:
            values = ["" if v is None else repr(float(v)) for v in row.values]
            writer.writerow([row.workload, row.sc_policy, row.tune, row.seed, row.total_gpus, *values])


def read_curves(path: Path) -> list[CurveRow]:
    """Read an ``alloc.csv``/``frag.csv`` (ours or the published one); errors name the file, line and column."""
    try:
        f = path.open(newline="")
    except FileNotFoundError:
        raise InvalidSpecError(f"{path}: no such file") from None
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise InvalidSpecError(f"{path}: the file is empty; expected the header {','.join(META_COLUMNS)},0,...")
        header = [h.strip() for h in header]
        missing = [c for c in META_COLUMNS if c not in header]
        if missing:
            raise InvalidSpecError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
        col = {name: k for k, name in enumerate(header)}
        points = [(a, col.get(str(a))) for a in ARRIVED_PERCENTS]
        rows: list[CurveRow] = []
        for line_no, record in enumerate(reader, start=2):
            if not record or all(not c.strip() for c in record):
                continue
            if len(record) != len(header):
                raise InvalidSpecError(f"{path}: line {line_no}: {len(record)} fields, the header has {len(header)}")
            seed = _parse_int(path, line_no, "seed", record[col["seed"]])
            total = _parse_int(path, line_no, "total_gpus", record[col["total_gpus"]])
            values: Curve = []
            for a, k in points:
                cell = record[k].strip() if k is not None else ""
                values.append(_parse_float(path, line_no, str(a), cell) if cell else None)
            rows.append(
                CurveRow(record[col["workload"]], record[col["sc_policy"]], record[col["tune"]], seed, total, values)
            )
    return rows


def write_summary(path: Path, results: Sequence[RunResult]) -> None:
    """``summary.json``: every run, and per workload and policy the mean and sd over seeds."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.spec.workload, r.spec.policy), []).append(r)
    aggregate = []
    for (workload, policy), runs in groups.items():
        entry: dict[str, object] = {"workload": workload, "policy": policy, "sc_policy": runs[0].spec.sc_policy}
        entry["seeds"] = [r.spec.seed for r in runs]
        for key, at in (("unallocated_gpu_pct_at_100", 100), ("unallocated_gpu_pct_at_130", 130)):
            mean, sd = mean_sd([r.unallocated_at(at) for r in runs])
            entry[key] = {"mean": _round(mean), "sd": _round(sd)}
        entry["failed_pods_mean"] = round(statistics.fmean(r.failed for r in runs), 1)
        entry["decisions_per_second_mean"] = round(statistics.fmean(r.decisions_per_second for r in runs), 1)
        entry["p99_decision_ms_max"] = round(max(r.p99_decision_ms for r in runs), 3)
        entry["wall_seconds_mean"] = round(statistics.fmean(r.wall_seconds for r in runs), 2)
        entry["cpu_seconds_mean"] = round(statistics.fmean(r.cpu_seconds for r in runs), 2)
        aggregate.append(entry)
    document = {"runs": [r.summary() for r in results], "aggregate": aggregate}
    path.write_text(json.dumps(document, indent=2) + "\n")


# ---- comparison with the published results ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """Unallocated GPU % at one arrived %: ours vs published, mean ± sd over seeds, per workload and policy."""

    workload: str
    sc_policy: str
    ours_mean: float | None
    ours_sd: float | None
    ours_n: int
    published_mean: float | None
    published_sd: float | None
    published_n: int
    bound_mean: float | None = None
    """LP lower bound on unallocated GPU % at 100 % arrived over the same seeds (``None``: not computed)."""
    bound_sd: float | None = None
    bound_n: int = 0
    failed_8gpu_mean: float | None = None
    """Eight-card pods (or larger) that failed, per seed (``None``: no ``summary.json``)."""

    @property
    def difference(self) -> float | None:
        """Ours minus published (percentage points; negative: we leave fewer GPUs unallocated)."""
        if self.ours_mean is None or self.published_mean is None:
            return None
        return round(self.ours_mean - self.published_mean, 2)

    def within(self, tolerance: float) -> bool | None:
        d = self.difference
        return None if d is None else abs(d) <= tolerance

    def as_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "sc_policy": self.sc_policy,
            "published_mean": self.published_mean,
            "published_sd": self.published_sd,
            "published_n": self.published_n,
            "ours_mean": self.ours_mean,
            "ours_sd": self.ours_sd,
            "ours_n": self.ours_n,
            "difference": self.difference,
            "bound_mean": self.bound_mean,
            "bound_sd": self.bound_sd,
            "bound_n": self.bound_n,
            "failed_8gpu_mean": self.failed_8gpu_mean,
        }


def read_run_facts(path: Path) -> list[dict[str, object]]:
    """The ``runs`` of a ``summary.json`` (empty when the file is absent)."""
    if not path.is_file():
        return []
    try:
        document = json.loads(path.read_text())
        runs = document["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidSpecError(f"{path}: not a summary.json written by `octacloud simulate` ({exc})") from None
    if not isinstance(runs, list):
        raise InvalidSpecError(f"{path}: 'runs' is not a list")
    return [r for r in runs if isinstance(r, dict)]


def compare(
    ours: Sequence[CurveRow],
    published: Sequence[CurveRow],
    *,
    at: int = 100,
    runs: Sequence[dict[str, object]] = (),
) -> list[Comparison]:
    """Per workload and policy of ``ours``: unallocated GPU % at arrived ``at`` %, ours vs published.

    Published rows of workloads we did not run are left out; a policy of ours that was never published gets
    ``None`` on the published side. ``runs`` (``summary.json``'s) add, at ``at`` = 100, the LP lower bound of
    the seeds each row ran and the failed eight-card pods per seed.
    """
    if not 0 <= at < len(ARRIVED_PERCENTS):
        raise InvalidSpecError(f"--at must be within 0..{ARRIVED_PERCENTS[-1]}, got {at}")
    mine, theirs = _unallocated(ours, at), _unallocated(published, at)
    keys = sorted(mine, key=lambda k: (_first_index(ours, k[0]), k[1]))
    seeds: dict[tuple[str, str], list[int]] = {}
    for row in ours:
        seeds.setdefault((row.workload, row.sc_policy), []).append(row.seed)
    bounds, large = _run_bounds(runs)
    table = []
    for key in keys:
        om, osd = mean_sd(mine[key])
        pm, psd = mean_sd(theirs.get(key, []))
        row_bounds = [bounds.get((key[0], s)) for s in seeds[key]] if at == 100 else []
        bm, bsd = mean_sd(row_bounds)
        failed_large = large.get(key)
        table.append(
            Comparison(
                key[0],
                key[1],
                _round(om),
                _round(osd),
                _count(mine[key]),
                _round(pm),
                _round(psd),
                _count(theirs.get(key, [])),
                _round(bm),
                _round(bsd),
                _count(row_bounds),
                None if not failed_large else round(statistics.fmean(failed_large), 1),
            )
        )
    return table


def _unallocated(rows: Sequence[CurveRow], at: int) -> dict[tuple[str, str], list[float | None]]:
    """Per (workload, policy): each row's unallocated GPU % at arrived ``at`` % (None where it has no value)."""
    out: dict[tuple[str, str], list[float | None]] = {}
    for row in rows:
        value = row.at(at)
        out.setdefault((row.workload, row.sc_policy), []).append(None if value is None else 100.0 - value)
    return out


def _run_bounds(
    runs: Sequence[dict[str, object]],
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, str], list[int]]]:
    """From ``summary.json``'s runs: the LP lower bound per (workload, seed), and the failed eight-card pods of
    each run per (workload, policy)."""
    bounds: dict[tuple[str, int], float] = {}
    large: dict[tuple[str, str], list[int]] = {}
    for r in runs:
        workload, seed, value = r.get("workload"), r.get("seed"), r.get("lower_bound_unallocated_pct_at_100")
        if isinstance(workload, str) and isinstance(seed, int) and isinstance(value, int | float):
            bounds[(workload, seed)] = float(value)
        failed = r.get("failed_by_shape")
        policy = r.get("sc_policy")
        if isinstance(workload, str) and isinstance(policy, str) and isinstance(failed, dict):
            count = sum(n for shape, n in failed.items() if isinstance(n, int) and _cards(shape) >= 8)
            large.setdefault((workload, policy), []).append(count)
    return bounds, large


def _cards(shape: str) -> int:
    """The card count of a ``failed_by_shape`` key (``8x1000``, ``1x460@T4``, ``cpu``: 0)."""
    count, sep, _ = shape.partition("x")
    return int(count) if sep and count.isdigit() else 0


def comparison_csv(table: Sequence[Comparison]) -> str:
    """The comparison as CSV text, one row per workload and policy (empty cells where a side is missing)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COMPARISON_COLUMNS)
    for row in table:
        record = row.as_dict()
        writer.writerow(["" if record[c] is None else record[c] for c in COMPARISON_COLUMNS])
    return buffer.getvalue()


def mean_sd(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the values that are not ``None`` (sd 0 for one value)."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    mean = statistics.fmean(present)
    return mean, statistics.stdev(present) if len(present) > 1 else 0.0


def _count(values: Iterable[float | None]) -> int:
    return sum(1 for v in values if v is not None)


def _first_index(rows: Sequence[CurveRow], workload: str) -> int:
    return next(k for k, r in enumerate(rows) if r.workload == workload)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _format_tune(tune: float) -> str:
    return repr(float(tune))


def _parse_int(path: Path, line: int, column: str, cell: str) -> int:
    try:
        return int(cell.strip())
    except ValueError:
        raise InvalidSpecError(f"{path}: line {line}: column {column!r}: {cell!r} is not an integer") from None


def _parse_float(path: Path, line: int, column: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise InvalidSpecError(f"{path}: line {line}: column {column!r}: {cell!r} is not a number") from None
    if not math.isfinite(value):
        raise InvalidSpecError(f"{path}: line {line}: column {column!r}: {cell!r} is not a finite number")
    return value
