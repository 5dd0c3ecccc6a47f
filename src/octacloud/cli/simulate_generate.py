"""``octacloud simulate generate workload|fleet|suite``: seeded openb-format workloads and fleets.

* ``workload --pods P.csv --nodes N.csv --spec 0.1@T4,cpu=1.5 --out Q.csv`` restricts a share of a trace's GPU
  request to model sets (:func:`octacloud.sim.generate.restrict_workload`);
* ``fleet --out N.csv --count 200 --mix A100-80G:3,L40:2`` writes a generated fleet, or ``--sample`` a stratified
  sample of a node file;
* ``suite --traces DIR --out DIR`` writes the robustness suite of docs/beating-fgd.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from octacloud.cli.simulate import _existing, _writing_to, generate_app
from octacloud.core.errors import InvalidSpecError


@generate_app.command("workload")
def generate_workload(
    pods: Path = typer.Option(..., "--pods", help="The base trace (openb pod file)."),
    nodes: Path = typer.Option(..., "--nodes", help="The fleet the family is meant for (restrictions must fit it)."),
    spec: str = typer.Option(
        ..., "--spec", help="SHARE@MODEL[|MODEL], comma-separated, plus cpu=X / mem=X; e.g. 0.1@T4,0.05@G3,cpu=1.5."
    ),
    seed: int = typer.Option(7, "--seed", help="Which pods are restricted (a family is a pure function of it)."),
    out: Path = typer.Option(..., "--out", help="The pod file to write."),
    gpu_memory: Path | None = typer.Option(None, "--gpu-memory", help="model,gpu_memory_mib table for the fleet."),
) -> None:
    """Write a workload family: the base trace with SHARE of its GPU request restricted to model sets."""
    from octacloud.sim.generate import parse_workload_spec, restrict_workload, write_pods
    from octacloud.sim.traces import read_gpu_memory_table, read_nodes, read_pods

    with _writing_to(out):
        table = None if gpu_memory is None else read_gpu_memory_table(_existing(gpu_memory, "--gpu-memory"))
        fleet = read_nodes(_existing(nodes, "--nodes"), gpu_memory=table)
        base = [p.request for p in read_pods(_existing(pods, "--pods"))]
        family, description = restrict_workload(base, fleet, parse_workload_spec(spec), seed=seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_pods(out, family)
    typer.echo(json.dumps(description, indent=2))


@generate_app.command("fleet")
def generate_fleet_command(
    out: Path = typer.Option(..., "--out", help="The node file to write (with a gpu_memory_mib column)."),
    count: int = typer.Option(200, "--count", help="Nodes (generated fleets)."),
    mix: str | None = typer.Option(None, "--mix", help="MODEL[:WEIGHT],... e.g. A100-80G:3,H800:1,A10:3.5,L40:2.5."),
    gpus: int = typer.Option(8, "--gpus", help="GPUs per node."),
    cpu: str = typer.Option("128", "--cpu", help="Cores per node, one or several choices: 96,128."),
    memory: str = typer.Option("1024", "--memory-gib", help="Host memory per node in GiB, choices: 768,1024."),
    card_memory: str = typer.Option("", "--card-gib", help="Card memory for models the table lacks: MODEL=GiB,..."),
    sample: Path | None = typer.Option(None, "--sample", help="Instead: a stratified sample of this node file."),
    fraction: float = typer.Option(0.25, "--fraction", help="With --sample: the share of each node kind kept."),
    seed: int = typer.Option(7, "--seed", help="The generator's seed."),
) -> None:
    """Write a fleet: COUNT nodes of GPUS cards in the proportions of --mix, or a sample of a node file."""
    from octacloud.sim.generate import generate_fleet, parse_mix, sample_fleet, write_nodes
    from octacloud.sim.traces import read_nodes

    with _writing_to(out):
        if sample is not None:
            rows = sample_fleet(read_nodes(_existing(sample, "--sample")), fraction, seed=seed)
        else:
            if mix is None:
                raise InvalidSpecError("--mix is required unless --sample is given")
            cards: dict[str, int] = {}
            for item in (i.strip() for i in card_memory.split(",") if i.strip()):
                model, eq, gib = item.partition("=")
                if not eq or not gib.strip().isdigit():
                    raise InvalidSpecError(f"--card-gib {card_memory!r}: each item is MODEL=GiB")
                cards[model.strip()] = int(gib)
            rows = generate_fleet(
                count,
                parse_mix(mix),
                gpus=gpus,
                cpu_cores=_int_choices(cpu, "--cpu"),
                memory_gib=_int_choices(memory, "--memory-gib"),
                gpu_memory_gib=cards,
                seed=seed,
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        write_nodes(out, rows)
    typer.echo(f"{len(rows)} nodes, {sum(r[3] for r in rows)} GPUs written to {out}")


def _int_choices(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidSpecError(f"{option} {text!r}: expected whole numbers separated by commas") from None
    if not values or any(v <= 0 for v in values):
        raise InvalidSpecError(f"{option} {text!r}: expected numbers > 0")
    return values


@generate_app.command("suite")
def generate_suite(
    traces: Path = typer.Option(..., "--traces", help="The openb folder (base traces and node files)."),
    out: Path = typer.Option(..., "--out", help="Folder for fleet_*.csv, gen_*.csv and suite.json."),
) -> None:
    """Write the robustness suite of docs/beating-fgd.md: its fleets and workload families."""
    from octacloud.sim.generate import SUITE_FAMILIES, write_suite

    with _writing_to(out):
        if not traces.is_dir():
            raise InvalidSpecError(f"--traces {traces}: no such folder")
        entries = write_suite(traces, out)
    fleets = {f.name: f.fleet for f in SUITE_FAMILIES}
    for entry in entries:
        typer.echo(f"gen_{entry['family']}.csv  fleet_{fleets[str(entry['family'])]}.csv  {entry['spec']}")


def register(root: typer.Typer) -> None:
    """Nothing to add to ``root``: importing this module adds its commands to ``octacloud simulate generate``."""
