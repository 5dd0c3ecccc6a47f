"""``octacloud simulate rack-loss`` and ``octacloud simulate generate racks``: failure domains in the simulator.

* ``octacloud simulate rack-loss --nodes N.csv --pods P.csv --policy octacloud,domain-aware,fgd --seeds 42
  --out DIR`` fills the fleet as the published protocol does, loses each rack alone and prints, per policy and
  seed, the allocation reached and the share of the lost GPU demand that could not be re-placed (also written
  to ``DIR/rackloss.json``); racks come from the node file's ``rack`` column or, when it has none, from the
  seeded generator (``--racks``, :mod:`octacloud.sim.domains`);
* ``octacloud simulate generate racks --nodes N.csv --seed 7 --out M.csv`` writes the node file with the
  generated ``zone``, ``rack`` and ``power_feed`` columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from octacloud.cli.simulate import _existing, _writing_to, app, generate_app
from octacloud.core.errors import InvalidSpecError

RACKS_HELP = "Rack generator: rack_gpus=32,rack_nodes=16,feed_racks=2,zones=3 (any subset; default: those)."


@app.command("rack-loss")
def rack_loss(
    nodes: Path = typer.Option(..., "--nodes", help="Fleet CSV (openb node list; a rack column is used if present)."),
    pods: Path = typer.Option(..., "--pods", help="Pods CSV."),
    policy: str = typer.Option("octacloud,domain-aware,fgd", "--policy", help="Comma-separated policies."),
    seeds: str = typer.Option("42", "--seeds", help="Seeds: 42-46, or 42,45."),
    racks: str = typer.Option("default", "--racks", help=RACKS_HELP),
    tune: float = typer.Option(1.3, "--tune", help="Inflate the trace to TUNE × cluster GPU capacity."),
    out: Path = typer.Option(..., "--out", help="Folder for rackloss.json (created if needed)."),
    jobs: int = typer.Option(1, "--jobs", help="Runs in parallel worker processes (results do not depend on it)."),
    gpu_memory: Path | None = typer.Option(None, "--gpu-memory", help="model,gpu_memory_mib table for the fleet."),
) -> None:
    """Lose each rack of a full fleet alone: the GPU demand that could not be re-placed, per policy and seed."""
    from octacloud.sim.domains import parse_domain_spec
    from octacloud.sim.experiment import check_policies, parse_seeds, run_parallel
    from octacloud.sim.rackloss import RackLossSpec, run_rack_loss

    with _writing_to(out):
        fleet, trace = _existing(nodes, "--nodes"), _existing(pods, "--pods")
        table = None if gpu_memory is None else _existing(gpu_memory, "--gpu-memory")
        if not 0 < tune <= 10:
            raise InvalidSpecError(f"--tune must be in (0, 10], got {tune}")
        spec = parse_domain_spec(racks)
        names = check_policies([p.strip() for p in policy.split(",") if p.strip()])
        specs = [RackLossSpec(fleet, trace, p, s, spec, tune, table) for s in parse_seeds(seeds) for p in names]
        out.mkdir(parents=True, exist_ok=True)
        results = run_parallel(run_rack_loss, specs, jobs=jobs)
        rows = [r.as_dict() for r in results]
        (out / "rackloss.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    Console(soft_wrap=True).print(_table(rows))


def _table(rows: list[dict[str, object]]) -> Table:
    """One row per run; ``alloc − plain`` is the allocation against plain ``octacloud`` of the same seed."""
    plain = {r["seed"]: r["allocation_pct"] for r in rows if r["policy"] == "octacloud"}
    table = Table(title="losing one rack of the full fleet (each rack alone)")
    for col in ("policy", "seed", "racks", "allocation %", "alloc − plain", "not re-placed %", "worst rack %",
                "racks not covered"):  # fmt: skip
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        base = plain.get(r["seed"])
        delta = "" if base is None else f"{float(str(r['allocation_pct'])) - float(str(base)):+.2f}"
        table.add_row(
            str(r["policy"]),
            str(r["seed"]),
            str(r["racks"]),
            f"{r['allocation_pct']:.2f}",
            delta,
            f"{r['unplaced_pct']:.2f}",
            f"{r['worst_rack_unplaced_pct']:.1f}",
            str(r["uncovered_racks"]),
        )
    return table


@generate_app.command("racks")
def generate_racks(
    nodes: Path = typer.Option(..., "--nodes", help="The fleet (openb node file)."),
    seed: int = typer.Option(7, "--seed", help="Which nodes share a rack (a pure function of it)."),
    racks: str = typer.Option("default", "--racks", help=RACKS_HELP),
    out: Path = typer.Option(..., "--out", help="The node file to write, with zone, rack and power_feed columns."),
    gpu_memory: Path | None = typer.Option(None, "--gpu-memory", help="model,gpu_memory_mib table for the fleet."),
) -> None:
    """Write the fleet with seeded failure domains: racks of one kind of server, power feeds, zones."""
    from octacloud.sim.domains import assign_domains, describe, parse_domain_spec, write_domain_nodes
    from octacloud.sim.traces import read_gpu_memory_table, read_nodes

    with _writing_to(out):
        table = None if gpu_memory is None else read_gpu_memory_table(_existing(gpu_memory, "--gpu-memory"))
        fleet = assign_domains(read_nodes(_existing(nodes, "--nodes"), gpu_memory=table), parse_domain_spec(racks),
                               seed=seed)  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        write_domain_nodes(out, fleet)
    typer.echo(json.dumps(describe(fleet), indent=2))


def register(root: typer.Typer) -> None:
    """Nothing to add to ``root``: importing this module adds its commands to ``octacloud simulate``."""
