"""``octacloud certs dev``: a local CA, a server certificate for 127.0.0.1/localhost and a client certificate."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.console import Console

from octacloud.cli.cloud import as_typed

console = Console()
err = Console(stderr=True)
certs_app = typer.Typer(help="TLS certificates for trying octacloud over TLS.", no_args_is_help=True)


@certs_app.command("dev")
def dev(
    out: Path = typer.Option(Path("var/tls"), "--out", help="Folder to write the PEM files into."),
    days: int = typer.Option(30, "--days", help="Validity in days."),
    force: bool = typer.Option(False, "--force", help="Replace files that exist."),
) -> None:
    """Make a development CA and certificates (not for production)."""
    from octacloud.core.errors import OctacloudError
    from octacloud.security.tls import make_dev_certs

    try:
        paths = make_dev_certs(out, days=days, force=force)
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    for name, path in paths.items():
        console.print(f"{name:>11}  {path}")
    octacloud = shlex.quote(as_typed("octacloud"))
    console.print(
        f"serve with:  {octacloud} up --tls-cert {paths['server.pem']} --tls-key {paths['server.key']}\n"
        f"clients:     export OCTACLOUD_URL=https://127.0.0.1:8000 OCTACLOUD_CACERT={paths['ca.pem']}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(certs_app, name="certs")
