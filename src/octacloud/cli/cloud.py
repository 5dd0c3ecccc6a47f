"""The operator's commands: deploy, status, scale, undeploy, events (``up`` and ``down`` are in ``cli/up.py``).

They talk to the running cloud's admin API (``--url``, default ``$OCTACLOUD_URL`` or http://127.0.0.1:8000)
with an API key (``--key``, default ``$OCTACLOUD_KEY``, else ``<state-dir>/admin.key``, which the first ``up``
writes) and, for https, the CA to trust (``--cacert``, default ``$OCTACLOUD_CACERT``).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from octacloud.cli.status_view import Filters, status_tables
from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS, summary


def _console(stderr: bool = False) -> Console:
    """A console that wraps no message, and that draws tables in full when its output is not a terminal
    (rich would otherwise cut them to 80 columns in a pipe or a file; $COLUMNS still wins)."""
    probe = Console(stderr=stderr)
    wide = not probe.is_terminal and "COLUMNS" not in os.environ
    return Console(stderr=stderr, soft_wrap=True, width=250 if wide else None)


console = _console()
err = _console(stderr=True)


def as_typed(program: str) -> str:
    """``program`` (``octacloud``, ``python``) as the user would type it to get the one running now: the file
    beside this interpreter (``.venv/bin/octacloud`` from the checkout, relative to the working folder when it
    is under it, else its absolute path), or the bare name when there is none (an install on PATH)."""
    exe = Path(sys.executable)
    beside = exe if program == "python" else exe.parent / program
    if not beside.exists():
        return program
    try:
        return str(beside.relative_to(Path.cwd())) if beside.is_absolute() else str(beside)
    except ValueError:
        return str(beside)


DEFAULT_URL = "http://127.0.0.1:8000"


def _url(url: str | None) -> str:
    return (url or os.environ.get("OCTACLOUD_URL") or DEFAULT_URL).rstrip("/")


URL: Any = typer.Option(None, "--url", help=f"The cloud's gateway (default: $OCTACLOUD_URL, else {DEFAULT_URL}).")
KEY: Any = typer.Option(
    None, "--key", envvar="OCTACLOUD_KEY", help="API key (default: $OCTACLOUD_KEY, else var/admin.key if present)."
)
CACERT: Any = typer.Option(None, "--cacert", envvar="OCTACLOUD_CACERT", help="CA certificate to trust (https).")


def _saved_key(state_dir: Path = Path("var")) -> str | None:
    """The admin key the first ``octacloud up`` saved in its state dir, when this is where it ran."""
    path = state_dir / "admin.key"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _call(
    method: str,
    url: str,
    path: str,
    body: dict[str, Any] | None = None,
    key: str | None = None,
    cacert: Path | None = None,
    optional: bool = False,
) -> dict[str, Any]:
    """The admin API's JSON answer; on an error it prints it and exits, unless ``optional`` and the key may not
    see ``path`` (403) or the cloud has no such path (404): then ``{}``."""
    key = key or _saved_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(cacert)) if cacert is not None else True
        response = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30.0, verify=verify)
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/] cannot reach the octacloud admin API at {url}: {exc} (is `octacloud up` running?)")
        raise typer.Exit(2) from None
    try:
        data: dict[str, Any] = response.json()
    except ValueError:
        data = {"error": response.text}
    if optional and response.status_code in (403, 404):
        return {}
    if response.status_code >= 400:
        err.print(f"[red]error:[/] {data.get('error', response.text)}")
        raise typer.Exit(1)
    return data


DEPLOY_MODEL: Any = typer.Argument(..., help="Model name in the repository (octacloud models list).")
DEPLOY_NAME: Any = typer.Option(None, "--name", help="Deployment name (default: the model's).")
DEPLOY_VERSION: Any = typer.Option(None, "--version", help="Model version (new: the latest).")
DEPLOY_OCTANTS: Any = typer.Option(
    None,
    "--octants",
    help="Octants per replica: 1-8, a multiple of 8 (whole cards), or auto (new: auto, sized to the model).",
)
DEPLOY_MIN_REPLICAS: Any = typer.Option(
    None, "--min-replicas", help="Fewest replicas, also the autoscaler's floor (new: 1)."
)
DEPLOY_MAX_REPLICAS: Any = typer.Option(
    None,
    "--max-replicas",
    help=f"Most replicas `scale` and the autoscaler may reach (new: {DEFAULT_MAX_REPLICAS}, or --min-replicas).",
)
DEPLOY_TARGET_QPS: Any = typer.Option(
    None, "--target-qps", help="Requests/s to size for (with --octants auto) and to autoscale towards."
)
DEPLOY_SLO_MS: Any = typer.Option(
    None, "--slo-ms", help="Latency objective (ms): the autoscaler adds a replica while it is broken."
)
DEPLOY_PRIORITY_CLASS: Any = typer.Option(
    None, "--priority-class", help="A priority class granted to the tenant (new: the tenant's default)."
)
DEPLOY_PRIORITY: Any = typer.Option(
    None,
    "--priority",
    help="A raw priority (admin keys only): higher preempts lower when the fleet is full; >= 100 may use the "
    "failover reserve.",
)
DEPLOY_TENANT: Any = typer.Option(
    None, "--tenant", help="Owner (admin keys only; new: the key's tenant, a redeploy: its owner)."
)
DEPLOY_PUBLISH: Any = typer.Option(
    None, "--publish/--no-publish", help="Let every tenant infer on it (new: not published)."
)
DEPLOY_SPREAD: Any = typer.Option(
    None,
    "--spread",
    help="Keep replicas apart: soft (other nodes, then racks, where they fit), node or rack (hard: one per "
    "node or rack; a replica that cannot be kept apart waits) (new: soft).",
)


def deploy(
    model: str = DEPLOY_MODEL,
    name: str | None = DEPLOY_NAME,
    version: str | None = DEPLOY_VERSION,
    octants: str | None = DEPLOY_OCTANTS,
    min_replicas: int | None = DEPLOY_MIN_REPLICAS,
    max_replicas: int | None = DEPLOY_MAX_REPLICAS,
    target_qps: float | None = DEPLOY_TARGET_QPS,
    slo_ms: float | None = DEPLOY_SLO_MS,
    priority_class: str | None = DEPLOY_PRIORITY_CLASS,
    priority: int | None = DEPLOY_PRIORITY,
    tenant: str | None = DEPLOY_TENANT,
    publish: bool | None = DEPLOY_PUBLISH,
    spread: str | None = DEPLOY_SPREAD,
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Deploy a model, or update a deployment of that name.

    A redeploy changes only what the command names: the replica count, min/max replicas, octants, version,
    target, publication and spread stay as the operator set them, and the answer says what was kept and what
    changed.
    """
    if octants is not None and octants != "auto" and not (octants.isascii() and octants.isdigit()):
        err.print(f"[red]error:[/] --octants must be a whole number or 'auto', got {octants!r}")
        raise typer.Exit(2)
    given = {
        "version": version,
        "octants": octants,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_qps": target_qps,
        "slo_ms": slo_ms,
        "priority_class": priority_class,
        "priority": priority,
        "tenant": tenant,
        "published": publish,
        "spread": spread,
    }
    body: dict[str, Any] = {"name": name or model, "model": model}
    body.update({k: v for k, v in given.items() if v is not None})
    if octants is not None:
        body["octants"] = None if octants == "auto" else int(octants)
    _print_deployed(_call("POST", _url(url), "/admin/deployments", body, key, cacert))


def _print_deployed(data: dict[str, Any]) -> None:
    """What a deploy answered: the deployment's size, what a redeploy kept and changed, how it was sized."""
    spec = data["spec"]
    console.print(f"deployed [bold]{spec['name']}[/]: {data['replicas']} replica(s) × {data['octants']} octant(s)")
    if data.get("kept") or data.get("changes"):
        console.print(f"  {summary(data.get('changes') or {}, data.get('kept') or {})}", soft_wrap=True)
    if data.get("sizing"):
        console.print(f"  sizing: {data['sizing']}", soft_wrap=True, highlight=False)


def status(
    url: str | None = URL,
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON instead of a table."),
    node: str = typer.Option("", "--node", help="Only nodes (and replicas on nodes) matching this glob."),
    deployment: str = typer.Option("", "--deployment", help="Only deployments matching this glob."),
    tenant: str = typer.Option("", "--tenant", help="Only deployments of tenants matching this glob."),
    replicas: bool = typer.Option(False, "--replicas", help="Every replica, however many (else summarised)."),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Deployments and their replicas: where each runs and in what state; for an admin key, the fleet's nodes
    with their failure domains (zone, rack, power feed) and free octants too. A big fleet is summarised (nodes
    by rack, replicas by deployment) until ``--node``, ``--deployment`` or ``--replicas`` narrows it down."""
    data = _call("GET", _url(url), "/admin/deployments", None, key, cacert)
    fleet = _call("GET", _url(url), "/admin/fleet", None, key, cacert, optional=True)
    filters = Filters(node=node, deployment=deployment, tenant=tenant)
    if as_json:
        data = {**data, "deployments": filters.deployments(data["deployments"])}
        if fleet:
            fleet = {**fleet, "nodes": filters.nodes(fleet.get("nodes", []))}
        console.print_json(json.dumps({**data, **({"fleet": fleet} if fleet else {})}))
        return
    for table in status_tables(data["deployments"], (fleet or {}).get("nodes") or [], filters, replicas):
        console.print(table)


def scale(
    name: str = typer.Argument(..., help="The deployment."),
    replicas: int = typer.Argument(..., help="Replicas wanted (within the deployment's min..max)."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Set a deployment's replica count."""
    data = _call("POST", _url(url), f"/admin/deployments/{name}/scale", {"replicas": replicas}, key, cacert)
    console.print(f"{name}: {data['replicas']} replica(s)")


def undeploy(
    name: str = typer.Argument(..., help="The deployment."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Remove a deployment and stop its replicas (their slices return to the pool)."""
    _call("DELETE", _url(url), f"/admin/deployments/{name}", None, key, cacert)
    console.print(f"undeployed {name}")


def events(
    url: str | None = URL,
    limit: int = typer.Option(30, "--limit", help="How many of the latest events."),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Recent controller events (placements, failures, restarts, preemptions)."""
    data = _call("GET", _url(url), f"/admin/events?limit={limit}", None, key, cacert)
    table = Table(title="events")
    for col in ("time", "kind", "subject", "message"):
        table.add_column(col)
    for e in reversed(data["events"]):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e["at"])))
        table.add_row(when, e["kind"], e["subject"], e["message"])
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(deploy)
    app.command()(status)
    app.command()(scale)
    app.command()(undeploy)
    app.command()(events)
