"""``octacloud rollout status|undo DEPLOYMENT``: where a rolling update stands, and going back (admin API).

Changing a deployment's model, version or octants (``octacloud deploy`` again) replaces its replicas one at a
time: a new replica starts, and only once it is ready does an old one stop (surge 1, none unavailable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from octacloud.cli.cloud import CACERT, KEY, URL, _call, _url, console

rollout_app = typer.Typer(help="Rolling updates: status and undo.", no_args_is_help=True)


def _show(data: dict[str, Any]) -> None:
    state = "complete" if data["complete"] else "in progress"
    console.print(
        f"deployment [bold]{data['deployment']}[/]: revision {data['revision']} "
        f"({data['model']} {data['version'] or 'latest'} × {data['octants']} octant(s)), "
        f"{data['updated']} of {data['desired']} replica(s) updated and ready: {state}"
    )
    table = Table(title="replicas")
    for col in ("replica", "state", "revision", "up to date", "replaces", "message"):
        table.add_column(col)
    for r in data["replicas"]:
        table.add_row(
            r["id"], r["state"], str(r["revision"]), "yes" if r["up_to_date"] else "no", r["replaces"], r["message"]
        )
    console.print(table)
    history = Table(title="revisions")
    for col in ("revision", "model", "version", "octants"):
        history.add_column(col)
    for h in data["history"]:
        history.add_row(str(h["revision"]), h["model"], h["version"] or "latest", str(h["octants"]))
    console.print(history)


@rollout_app.command("status")
def rollout_status(
    deployment: str = typer.Argument(..., help="The deployment's name."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Revisions of a deployment and which replicas run the current one."""
    _show(_call("GET", _url(url), f"/admin/deployments/{deployment}/rollout", None, key, cacert))


@rollout_app.command("undo")
def rollout_undo(
    deployment: str = typer.Argument(..., help="The deployment's name."),
    to_revision: int | None = typer.Option(
        None, "--to-revision", help="Go back to this revision (default: the previous one)."
    ),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Roll back to the previous model, version and octants (as a new revision, replica by replica)."""
    body: dict[str, Any] = {} if to_revision is None else {"revision": to_revision}
    _show(_call("POST", _url(url), f"/admin/deployments/{deployment}/rollout/undo", body, key, cacert))


def register(app: typer.Typer) -> None:
    app.add_typer(rollout_app, name="rollout")
