"""``octacloud simulate``: replay traces under the published protocol (or churn), and compare with the paper.

* ``octacloud simulate --nodes N.csv --pods P.csv [--pods Q.csv] --policy fgd,bestfit --seeds 42-51 --out DIR``
  writes ``alloc.csv``, ``frag.csv``, ``summary.json`` and PNGs;
* with ``--arrivals poisson:RATE --lifetime lognormal:MU,SIGMA --duration SECONDS`` it runs churn mode instead
  and writes ``churn.json`` (time-averaged GPU allocation, failed and queued requests) and ``churn_*.png``;
* ``octacloud simulate compare DIR [DIR...] [--published fgd_published_alloc.csv]`` lines our results up with
  the paper's, with the LP lower bound of the same seeds next to every policy;
* ``octacloud simulate generate workload|fleet|suite`` writes seeded openb-format workloads and fleets
  (:mod:`octacloud.sim.generate`), in ``cli/simulate_generate.py``; ``rack-loss`` and ``generate racks`` are in
  ``cli/simulate_racks.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from octacloud.cli import simulate_options as options
from octacloud.core.errors import InvalidSpecError

if TYPE_CHECKING:
    from octacloud.sim.experiment import ChurnResult, RunResult
    from octacloud.sim.report import Comparison

app = typer.Typer(
    name="simulate",
    help="Fleet-scale simulation: the FGD paper's protocol, churn mode, and comparison with published results.",
    add_completion=False,
)


def _console() -> Console:
    """Stdout console; wide when not a terminal (a log file), so that tables do not wrap."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


@contextmanager
def _writing_to(out: Path) -> Iterator[None]:
    """A generator's work for ``--out``: a bad spec is the command's error as it says, a file that cannot be
    written (or read) is the error naming ``--out``."""
    try:
        yield
    except InvalidSpecError as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _fail(f"--out {out}: {exc.strerror or exc}") from None


def _existing(path: Path | None, option: str) -> Path:
    if path is None:
        raise InvalidSpecError(f"{option} is required")
    if not path.is_file():
        raise InvalidSpecError(f"{option} {path}: no such file")
    return path


@app.callback(invoke_without_command=True)
def simulate(
    ctx: typer.Context,
    nodes: Path | None = options.NODES,
    pods: list[Path] | None = options.PODS,
    policy: str = options.POLICY,
    seeds: str = options.SEEDS,
    tune: float = options.TUNE,
    out: Path | None = options.OUT,
    jobs: int = options.JOBS,
    plots: bool = options.PLOTS,
    arrivals: str | None = options.ARRIVALS,
    lifetime: str = options.LIFETIME,
    duration: float = options.DURATION,
    warmup: float = options.WARMUP,
    queue: bool = options.QUEUE,
    period: float = options.PERIOD,
    defrag: int = options.DEFRAG,
    reservations: int = options.RESERVATIONS,
    serve_releases: bool = options.SERVE_RELEASES,
    gpu_memory: Path | None = options.GPU_MEMORY,
    bound: bool = options.BOUND,
) -> None:
    """Replay traces under the FGD paper's protocol (or in churn mode) and write results to --out."""
    if ctx.invoked_subcommand is not None:
        return
    from octacloud.core.extras import MissingExtraError, require
    from octacloud.sim.experiment import ChurnSpec, RunSpec, check_policies, parse_seeds
    from octacloud.sim.synthetic import parse_arrivals, parse_lifetime

    try:
        if plots:
            require("plots")
        fleet, traces, out = _inputs(nodes, pods, out, jobs)
        policies = check_policies([p.strip() for p in policy.split(",") if p.strip()])
        seed_list = parse_seeds(seeds)
        memory_table = None if gpu_memory is None else _existing(gpu_memory, "--gpu-memory")
        _check_traces(fleet, traces, memory_table)
        runs = [(t, p, s) for t in traces for p in policies for s in seed_list]
        specs: list[object]
        if arrivals is None:
            if not 0 < tune <= 10:
                raise InvalidSpecError(f"--tune must be in (0, 10], got {tune}")
            specs = [RunSpec(fleet, t, p, s, tune, memory_table, bound) for t, p, s in runs]
        else:
            _check_churn(defrag, reservations, queue, duration, warmup, period)
            arrival_spec, lifetime_spec = parse_arrivals(arrivals), parse_lifetime(lifetime)
            churn = (arrival_spec, lifetime_spec, duration, queue, period, warmup, defrag, memory_table)
            specs = [ChurnSpec(fleet, t, p, s, *churn, reservations, serve_releases) for t, p, s in runs]
        out.mkdir(parents=True, exist_ok=True)
    except (InvalidSpecError, MissingExtraError) as exc:
        raise _fail(f"{exc} (or pass --no-plots)" if isinstance(exc, MissingExtraError) else str(exc)) from None
    except OSError as exc:
        raise _fail(f"--out {out}: {exc.strerror or exc}") from None

    _run(specs, out, jobs, plots, churn=arrivals is not None)


def _run(specs: Sequence[object], out: Path, jobs: int, plots: bool, *, churn: bool) -> None:
    """Run the protocol's specs (or churn mode's) and write their results to ``out``; a bad spec is the error."""
    try:
        if churn:
            _run_churn(specs, out, jobs, plots)
        else:
            _run_protocol(specs, out, jobs, plots)
    except InvalidSpecError as exc:
        raise _fail(str(exc)) from None


def _inputs(nodes: Path | None, pods: list[Path] | None, out: Path | None, jobs: int) -> tuple[Path, list[Path], Path]:
    """The fleet, the traces and the output folder, checked: each is given, exists and is told apart."""
    fleet = _existing(nodes, "--nodes")
    traces = [_existing(p, "--pods") for p in (pods or [])]
    if not traces:
        raise InvalidSpecError("--pods is required (repeat it for several traces)")
    if len({t.stem for t in traces}) != len(traces):
        raise InvalidSpecError("--pods: two traces have the same file name; results are keyed by it")
    if out is None:
        raise InvalidSpecError("--out is required: the folder for alloc.csv, frag.csv, summary.json and PNGs")
    if jobs < 1:
        raise InvalidSpecError(f"--jobs must be >= 1, got {jobs}")
    return fleet, traces, out


def _check_churn(defrag: int, reservations: int, queue: bool, duration: float, warmup: float, period: float) -> None:
    """Churn mode's own options, checked before any run starts."""
    if defrag < 0:
        raise InvalidSpecError(f"--defrag: moves per pass must be >= 0, got {defrag}")
    if reservations < 0:
        raise InvalidSpecError(f"--reservations must be >= 0, got {reservations}")
    if defrag and not queue:
        raise InvalidSpecError("--defrag needs --queue: defragmentation makes room for requests that wait")
    if duration <= 0 or not 0 <= warmup < duration or period <= 0:
        raise InvalidSpecError(
            f"churn: need --duration > 0, 0 <= --warmup < --duration and --period > 0 "
            f"(got {duration}, {warmup}, {period})"
        )


def _check_traces(fleet: Path, traces: Sequence[Path], gpu_memory: Path | None = None) -> None:
    """Read every input once up front, so that a malformed row stops the command before any run starts."""
    from octacloud.sim.traces import read_gpu_memory_table, read_nodes, read_pods

    table = None if gpu_memory is None else read_gpu_memory_table(gpu_memory)
    if not any(node.gpu_count for node in read_nodes(fleet, gpu_memory=table)):
        raise InvalidSpecError(f"--nodes {fleet}: the fleet has no GPUs")
    for trace in traces:
        if not read_pods(trace):
            raise InvalidSpecError(f"--pods {trace}: the trace has no pods")


def _progress(console: Console) -> Progress:
    """A live bar on a terminal; elsewhere (a log file) nothing live: :func:`_log_line` prints one line per run."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


def _log_line(console: Console, progress: Progress, task: TaskID, text: str) -> None:
    progress.update(task, advance=1, description=text)
    if not console.is_terminal:
        done = int(progress.tasks[0].completed)
        console.print(f"[{done}/{progress.tasks[0].total:.0f}] {text}", highlight=False)


def _run_protocol(specs: Sequence[object], out: Path, jobs: int, plots: bool) -> None:
    from octacloud.sim.experiment import RunSpec, run_many
    from octacloud.sim.report import curve_rows, write_curves, write_summary

    console = _console()
    run_specs = [s for s in specs if isinstance(s, RunSpec)]
    with _progress(console) as progress:
        task = progress.add_task("simulating", total=len(run_specs))

        def done(result: RunResult) -> None:
            s = result.spec
            text = f"{s.workload} {s.policy} seed {s.seed}: {result.unallocated_at(100)} % unallocated at 100 %"
            _log_line(console, progress, task, f"{text} ({result.wall_seconds:.1f} s)")

        results = run_many(run_specs, jobs=jobs, on_result=done)
    alloc_rows = curve_rows(results, "alloc")
    write_curves(out / "alloc.csv", alloc_rows)
    write_curves(out / "frag.csv", curve_rows(results, "frag"))
    write_summary(out / "summary.json", results)
    if plots:
        from octacloud.sim.plots import unallocated_bars, unallocated_curves

        unallocated_curves(alloc_rows, out)
        unallocated_bars(alloc_rows, out)
    console.print(_results_table(results))
    console.print(f"results in {out}/ (alloc.csv, frag.csv, summary.json{', *.png' if plots else ''})")


def _results_table(results: Sequence[RunResult]) -> Table:
    from octacloud.sim.report import mean_sd

    table = Table(title="unallocated GPU % (mean ± sd over seeds)")
    for name, justify in (
        ("workload", "left"),
        ("policy", "left"),
        ("seeds", "right"),
        ("@100 %", "right"),
        ("@130 %", "right"),
        ("failed pods", "right"),
        ("decisions/s", "right"),
        ("p99 ms", "right"),
        ("s/run", "right"),
        ("cpu s/run", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.spec.workload, r.spec.policy), []).append(r)
    for (workload, policy), runs in groups.items():
        cells = []
        for at in (100, 130):
            mean, sd = mean_sd(r.unallocated_at(at) for r in runs)
            cells.append("n/a" if mean is None else f"{mean:.2f} ± {sd or 0.0:.2f}")
        n = len(runs)
        table.add_row(
            workload,
            policy,
            str(n),
            *cells,
            f"{sum(r.failed for r in runs) / n:.0f}",
            f"{sum(r.decisions_per_second for r in runs) / n:,.0f}",
            f"{max(r.p99_decision_ms for r in runs):.2f}",
            f"{sum(r.wall_seconds for r in runs) / n:.1f}",
            f"{sum(r.cpu_seconds for r in runs) / n:.1f}",
        )
    return table


def _run_churn(specs: Sequence[object], out: Path, jobs: int, plots: bool) -> None:
    from octacloud.sim.experiment import ChurnSpec, run_churn, run_parallel

    console = _console()
    churn_specs = [s for s in specs if isinstance(s, ChurnSpec)]
    with _progress(console) as progress:
        task = progress.add_task("churn", total=len(churn_specs))

        def done(result: ChurnResult) -> None:
            s = result.spec
            text = f"{s.workload} {s.policy} seed {s.seed}: {result.report.time_avg_allocated_pct:.2f} % allocated"
            _log_line(console, progress, task, f"{text} ({result.wall_seconds:.1f} s)")

        results = run_parallel(run_churn, churn_specs, jobs=jobs, on_result=done)
    (out / "churn.json").write_text(json.dumps({"runs": [r.summary() for r in results]}, indent=2) + "\n")
    if plots:
        from octacloud.sim.plots import churn_timelines

        churn_timelines(results, out)
    table = Table(title="churn: time-averaged GPU allocation")
    columns = ("workload", "policy", "seed", "offered %", "allocated %", "placed", "failed", "queued", "wait s")
    classes = ("share", "one card", "multi-card")
    for name in (*columns, *(f"{c} wait mean/p95 (queued; with queued)" for c in classes), "moves"):
        table.add_column(name, justify="left" if name in ("workload", "policy") else "right")
    for r in results:
        rep = r.report
        table.add_row(
            r.spec.workload,
            r.spec.policy,
            str(r.spec.seed),
            f"{r.offered_load_pct:.1f}",
            f"{rep.time_avg_allocated_pct:.2f}",
            str(rep.placed),
            str(rep.failed),
            str(rep.queued_at_end),
            f"{rep.mean_wait_seconds:.1f}",
            *(
                "—"
                if c not in rep.waits
                else (
                    f"{rep.waits[c].mean:.1f}/{rep.waits[c].p95:.1f} ({rep.waits[c].queued_at_end}; "
                    f"{rep.waits[c].mean_with_queued:.1f}/{rep.waits[c].p95_with_queued:.1f})"
                )
                for c in classes
            ),
            str(r.moves),
        )
    console.print(table)
    console.print(f"results in {out}/ (churn.json{', churn_*.png' if plots else ''})")


@app.command("compare")
def compare(
    results_dirs: list[Path] = typer.Argument(..., help="Folders written by `octacloud simulate` (with alloc.csv)."),
    published: Path | None = typer.Option(
        None, "--published", help="The published alloc CSV (fgd_published_alloc.csv); without it: ours only."
    ),
    at: int = typer.Option(100, "--at", help="Arrived GPU % at which to compare (0..130)."),
    tolerance: float = typer.Option(0.5, "--tolerance", help="Percentage points within which a row matches."),
    output_format: str = typer.Option("table", "--format", help="table, csv or json."),
) -> None:
    """Side by side: published vs our unallocated GPU % (mean ± sd over seeds) per workload and policy, with the
    LP lower bound of the same seeds (at 100 %) and the failed eight-card pods per seed."""
    from octacloud.sim.report import compare as compare_rows
    from octacloud.sim.report import comparison_csv, read_curves, read_run_facts

    try:
        if output_format not in ("table", "csv", "json"):
            raise InvalidSpecError(f"--format must be table, csv or json, got {output_format!r}")
        ours, runs = [], []
        for results_dir in results_dirs:
            ours_path = results_dir / "alloc.csv"
            if not results_dir.is_dir():
                raise InvalidSpecError(f"{results_dir}: no such folder (give the --out folder of `octacloud simulate`)")
            if not ours_path.is_file():
                raise InvalidSpecError(
                    f"{results_dir}: no alloc.csv here; run `octacloud simulate --out {results_dir}`"
                )
            ours.extend(read_curves(ours_path))
            runs.extend(read_run_facts(results_dir / "summary.json"))
        theirs = [] if published is None else read_curves(_existing(published, "--published"))
        table = compare_rows(ours, theirs, at=at, runs=runs)
    except InvalidSpecError as exc:
        raise _fail(str(exc)) from None
    if output_format == "csv":
        typer.echo(comparison_csv(table), nl=False)
    elif output_format == "json":
        typer.echo(json.dumps([row.as_dict() for row in table], indent=2))
    else:
        _console().print(_comparison_table(table, at, tolerance, published is not None))


def _comparison_table(rows: Sequence[Comparison], at: int, tolerance: float, with_published: bool = True) -> Table:
    def fmt(mean: float | None, sd: float | None, n: int) -> str:
        return "—" if mean is None else f"{mean:.2f} ± {sd or 0.0:.2f} (n={n})"

    title = f"unallocated GPU % at {at} % arrived: " + ("published vs octacloud" if with_published else "ours")
    table = Table(title=title)
    columns = ["workload", "policy"]
    if with_published:
        columns += ["published"]
    columns += ["ours", "LP bound", "ours − bound", "8-card failed"]
    if with_published:
        columns += ["diff", f"|diff| ≤ {tolerance:g}"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("workload", "policy") else "right")
    for row in rows:
        within = row.within(tolerance)
        diff = row.difference
        gap = None if row.ours_mean is None or row.bound_mean is None else row.ours_mean - row.bound_mean
        cells = [row.workload, row.sc_policy]
        if with_published:
            cells.append(fmt(row.published_mean, row.published_sd, row.published_n))
        cells += [
            fmt(row.ours_mean, row.ours_sd, row.ours_n),
            fmt(row.bound_mean, row.bound_sd, row.bound_n),
            "—" if gap is None else f"{gap:.2f}",
            "—" if row.failed_8gpu_mean is None else f"{row.failed_8gpu_mean:.1f}",
        ]
        if with_published:
            cells += [
                "—" if diff is None else f"{diff:+.2f}",
                "—" if within is None else ("yes" if within else "[red]no[/red]"),
            ]
        table.add_row(*cells)
    return table


generate_app = typer.Typer(
    name="generate",
    help="Seeded openb-format workloads and fleets (see octacloud.sim.generate and docs/simulator.md).",
    add_completion=False,
    no_args_is_help=True,
)
app.add_typer(generate_app, name="generate")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="simulate")
