"""``octacloud fleet generate``: a fleet file for a fleet of any size (control/fleet_gen.py), e.g. the 1,000 cards
of an emulated cloud: ``octacloud fleet generate --nodes 125 --cards 8 --out fleet.yaml``, then
``octacloud up --fleet fleet.yaml --emulate``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

fleet_app = typer.Typer(help="Fleet files: generate one for a fleet of any size.", no_args_is_help=True)
_err = Console(stderr=True, soft_wrap=True)


@fleet_app.command("generate")
def generate(
    nodes: int = typer.Option(125, "--nodes", help="How many nodes."),
    cards: int = typer.Option(8, "--cards", help="Cards per node."),
    racks: int = typer.Option(5, "--racks", help="Racks (each node's `rack` domain), filled in order."),
    zones: int = typer.Option(1, "--zones", help="Zones (each node's `zone` domain), racks filling them in order."),
    model: list[str] = typer.Option(
        [], "--model", help="Card model NAME:MiB (repeatable; nodes cycle over them). Default: H100, A100, L40S, T4."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write here (default: standard output)."),
) -> None:
    """Write a fleet file of NODES × CARDS cards (mixed card models, racks and zones as failure domains)."""
    from octacloud.control.fleet_gen import DEFAULT_MODELS, FleetShape, fleet_yaml
    from octacloud.core.errors import OctacloudError

    try:
        shape = FleetShape(nodes=nodes, cards=cards, racks=racks, zones=zones, models=tuple(model) or DEFAULT_MODELS)
    except OctacloudError as exc:
        _err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    text = fleet_yaml(shape)
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    _err.print(f"wrote {out}: {nodes} node(s) × {cards} card(s) = {nodes * cards} cards")


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
