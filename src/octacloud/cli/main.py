"""Entry point of the ``octacloud`` console script.

Each command lives in its own module under ``octacloud.cli`` and exposes ``register(app)``; this file only
lists them, so that importing one command never imports the dependencies of another until it runs.
"""

from __future__ import annotations

import importlib

import typer

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
    "simulate_racks",
    "tenant",
    "top",
    "usage",
    "certs",
    "k8s",
)
"""Modules under ``octacloud.cli`` whose ``register(app)`` adds their commands."""

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


for _name in COMMAND_MODULES:
    importlib.import_module(f"octacloud.cli.{_name}").register(app)


def main() -> None:
    app()
