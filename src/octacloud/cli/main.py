"""Entry point of the ``octacloud`` console script.

Each command lives in its own module under ``octacloud.cli`` and exposes ``register(app)``; this file only
lists them, so that importing one command never imports the dependencies of another until it runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
import typer.core
import typer.models

from octacloud import __version__

COMMAND_MODULES: tuple[str, ...] = (
    "up",
    "down",
    "cloud",
    "convert",
    "models",
    "rollout",
    "node",
    "fleet",
    "schedule",
    "serve",
    "simulate",
    "simulate_generate",
    "simulate_racks",
    "tenant",
    "top",
    "usage",
    "certs",
    "k8s",
)
"""Modules under ``octacloud.cli`` whose ``register(app)`` adds their commands."""

PANELS: dict[str, tuple[str, ...]] = {
    "Operate the cloud": ("up", "down", "deploy", "status", "scale", "undeploy", "rollout", "events", "top"),
    "Tenants and usage": ("tenant", "key", "priority-class", "usage"),
    "Models": ("models", "convert", "serve"),
    "Cluster": ("node", "fleet", "k8s", "certs"),
    "Research": ("simulate", "schedule"),
}
"""The groups ``octacloud --help`` shows the commands in (every command belongs in one)."""

app = typer.Typer(
    name="octacloud",
    help="octacloud: a GPU inference cloud for bare-metal GPU servers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"octacloud {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """octacloud: a GPU inference cloud for bare-metal GPU servers."""


def command_name(info: typer.models.CommandInfo | typer.models.TyperInfo) -> str:
    """A registered command's or group's name, as the command line spells it."""
    if isinstance(info.name, str):
        return info.name
    callback = info.callback
    return "" if callback is None else callback.__name__.replace("_", "-")


def _group_commands(root: typer.Typer) -> None:
    """Put each command in its panel of :data:`PANELS` (one missing there stays under "Commands", and
    ``tests/cli/test_help.py`` fails)."""
    panel_of = {name: panel for panel, names in PANELS.items() for name in names}
    infos: list[typer.models.CommandInfo | typer.models.TyperInfo] = [
        *root.registered_commands,
        *root.registered_groups,
    ]
    for info in infos:
        info.rich_help_panel = panel_of.get(command_name(info), info.rich_help_panel)


def _flags_without_type() -> None:
    """Show a flag (``--publish``, ``--help``) without a ``<bool>`` type in ``--help``: it takes no value. Typer's
    plain help leaves the type out for flags; its rich help does not (typer 0.29), so the rich one is told to."""
    shown = typer.core.TyperOption.display_type_rich

    def display_type_rich(self: typer.core.TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    typer.core.TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


for _name in COMMAND_MODULES:
    importlib.import_module(f"octacloud.cli.{_name}").register(app)
_group_commands(app)
_flags_without_type()


def main() -> None:
    app()
