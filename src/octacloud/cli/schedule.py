"""``octacloud schedule``: place a trace on a fleet, in file order, and print a summary."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from octacloud.core.errors import InvalidSpecError
from octacloud.core.units import MILLI_PER_GPU


def schedule(
    nodes: Path = typer.Option(..., "--nodes", help="Fleet CSV (openb node list: sn,cpu_milli,memory_mib,gpu,model)."),
    pods: Path = typer.Option(..., "--pods", help="Pods CSV (openb pod list), placed in file order."),
    policy: str = typer.Option("fgd", "--policy", help="Placement policy (random, dotprod, clustering, ..., fgd)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the node tie-break order and random choices."),
    show_failed: int = typer.Option(5, "--show-failed", min=0, help="List this many most frequent failed shapes."),
) -> None:
    """Place every pod of PODS on an empty fleet (no inflation, no departures) and summarise."""
    # Imported here so that `octacloud --help` does not load the scheduler.
    from octacloud.scheduler.fragmentation import TargetWorkload
    from octacloud.sim.experiment import check_policies, place
    from octacloud.sim.traces import read_nodes, read_pods

    err = Console(stderr=True)
    try:
        check_policies([policy])
        fleet = read_nodes(nodes)
        requests = [p.request for p in read_pods(pods)]
        if not requests:
            raise InvalidSpecError(f"{pods}: the trace has no pods")
        workload = TargetWorkload.from_requests(requests)
        run = place(fleet, requests, policy=policy, seed=seed, workload=workload)
    except InvalidSpecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None

    recorder, state = run.recorder, run.state
    stats = recorder.decision_stats()
    capacity = state.total_gpu_milli
    allocated = state.allocated_gpu_milli
    table = Table(title=f"{pods.name} on {nodes.name} — {policy} (seed {seed})", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("nodes / GPUs", f"{len(state)} / {capacity // MILLI_PER_GPU}")
    table.add_row("pods", str(len(recorder)))
    table.add_row("placed", str(recorder.placed))
    table.add_row("failed", str(recorder.failed))
    table.add_row("allocated milli-GPU", f"{allocated} / {capacity}")
    table.add_row("allocated GPU %", f"{100.0 * allocated / capacity:.2f}" if capacity else "n/a")
    table.add_row("fragmentation rate %", f"{recorder.final_frag_rate():.2f}")
    table.add_row("decisions/s", f"{stats.per_second:,.0f}")
    table.add_row("p50 / p99 decision ms", f"{stats.p50_ms:.3f} / {stats.p99_ms:.3f}")
    for shape, count in recorder.failed_by_shape.most_common(show_failed):
        table.add_row(f"failed {shape}", str(count))
    console = Console()
    (console if console.is_terminal else Console(width=160)).print(table)


def register(app: typer.Typer) -> None:
    app.command("schedule")(schedule)
