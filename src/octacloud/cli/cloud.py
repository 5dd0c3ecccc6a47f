"""``octacloud up`` and the operator's commands: deploy, status, scale, undeploy, fleet, events.

``up`` runs the cloud in the foreground; the other commands talk to its admin API (``--url``, default
``$OCTACLOUD_URL`` or http://127.0.0.1:8000) with an API key (``--key``, default ``$OCTACLOUD_KEY``; the first
``up`` writes an admin key to ``<state-dir>/admin.key``) and, for https, the CA to trust (``--cacert``,
default ``$OCTACLOUD_CACERT``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

console = Console()
err = Console(stderr=True)

DEFAULT_URL = "http://127.0.0.1:8000"


def _url(url: str | None) -> str:
    return (url or os.environ.get("OCTACLOUD_URL") or DEFAULT_URL).rstrip("/")


KEY: Any = typer.Option(None, "--key", envvar="OCTACLOUD_KEY", help="API key (see <state-dir>/admin.key).")
CACERT: Any = typer.Option(None, "--cacert", envvar="OCTACLOUD_CACERT", help="CA certificate to trust (https).")


def _call(
    method: str,
    url: str,
    path: str,
    body: dict[str, Any] | None = None,
    key: str | None = None,
    cacert: Path | None = None,
) -> dict[str, Any]:
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
    if response.status_code >= 400:
        err.print(f"[red]error:[/] {data.get('error', response.text)}")
        raise typer.Exit(1)
    return data


def up(
    repository: Path = typer.Option(Path("models"), "--repository", "-r", help="Model repository (Triton layout)."),
    fleet: Path | None = typer.Option(None, "--fleet", help="Fleet file (YAML); default: discover this host."),
    state_dir: Path = typer.Option(Path("var"), "--state-dir", help="Where the state store and replica logs live."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the gateway binds."),
    http_port: int = typer.Option(8000, "--http-port"),
    grpc_port: int = typer.Option(8001, "--grpc-port"),
    policy: str = typer.Option("octacloud", "--policy", help="Scheduling profile (built-in name or file)."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between reconcile passes."),
    cpu_cards: int = typer.Option(1, "--cpu-cards", help="Without GPUs: how many CPU 'cards' this host offers."),
    deploy: list[str] = typer.Option([], "--deploy", help="Deploy MODEL (1 octant, 1 replica) once up."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Serve REST and gRPC over TLS with this cert."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The TLS certificate's private key."),
    tls_client_ca: Path | None = typer.Option(None, "--tls-client-ca", help="Require client certs from this CA."),
    allow_insecure: bool = typer.Option(False, "--allow-insecure", help="Allow plain text off loopback."),
    meter_interval: float = typer.Option(10.0, "--meter-interval", help="Seconds per usage-ledger interval."),
    prices: Path | None = typer.Option(None, "--prices", help="Price sheet (YAML) for usage reports."),
    telemetry_interval: float = typer.Option(
        1.0, "--telemetry-interval", help="Seconds between GPU telemetry samples (the dashboard and the scheduler)."
    ),
    backend: str = typer.Option("local", "--backend", help="Where replicas run: local (this machine) or ray."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", "--ray", help="The Ray cluster (HOST:PORT; default: auto). Implies --backend ray."
    ),
    model_storage: str | None = typer.Option(
        None, "--model-storage", help="On Ray: the repository as nodes reach it (shared path or fsspec URL)."
    ),
    model_cache: Path | None = typer.Option(None, "--model-cache", help="On Ray: each node's model cache folder."),
    limit: list[str] = typer.Option([], "--limit", help="Gateway bound NAME=VALUE (docs/security.md); repeatable."),
) -> None:
    """Run the cloud: fleet, controller, replicas on slices, and the OIP gateway (on this machine, or on Ray)."""
    from octacloud.app import Cloud, CloudConfig, ray_cloud
    from octacloud.cluster.controller import ControllerSettings
    from octacloud.cluster.deployments import DeploymentSpec
    from octacloud.cluster.tls import TlsConfig
    from octacloud.core.errors import OctacloudError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per metrics scrape and probe
    for flag, value in (("--interval", interval), ("--meter-interval", meter_interval),
                        ("--telemetry-interval", telemetry_interval)):  # fmt: skip
        if not value > 0:
            err.print(f"[red]error:[/] {flag} must be a positive number of seconds, got {value:g}")
            raise typer.Exit(2)
    from octacloud.cluster.gateway.limits import GatewayLimits

    try:
        limits = GatewayLimits.parse(limit)
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if not repository.is_dir():
        err.print(f"[red]error:[/] model repository {repository} does not exist (build the examples: make models)")
        raise typer.Exit(2)
    config = CloudConfig(
        repository=repository,
        state_dir=state_dir,
        fleet_file=fleet,
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        policy=policy,
        cpu_cards=cpu_cards,
        controller=ControllerSettings(interval_s=interval),
        tls=TlsConfig(tls_cert, tls_key, tls_client_ca) if tls_cert is not None and tls_key is not None else None,
        allow_insecure=allow_insecure,
        meter_interval_s=meter_interval,
        telemetry_interval_s=telemetry_interval,
        prices=prices,
        ray_address=ray_address,
        model_storage=model_storage,
        model_cache=model_cache,
        limits=limits,
    )
    if backend not in ("local", "ray"):
        err.print(f"[red]error:[/] --backend must be local or ray, got {backend!r}")
        raise typer.Exit(2)
    on_ray = backend == "ray" or ray_address is not None
    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/] --tls-cert and --tls-key go together")
        raise typer.Exit(2)

    async def main() -> None:
        try:
            cloud = ray_cloud(config) if on_ray else Cloud(config)
        except OctacloudError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, cloud.request_stop)
        await cloud.start()
        for model in deploy:
            try:
                cloud.controller.deploy(DeploymentSpec(name=model, model=model, tenant="admin"))
            except OctacloudError as exc:
                err.print(f"[red]cannot deploy {model}:[/] {exc}")
        _print_fleet_summary(cloud)
        scheme = "https" if config.tls is not None else "http"
        console.print(
            f"octacloud is up: OIP REST {scheme}://{host}:{cloud.http_port}  gRPC {host}:{cloud.grpc_port}  "
            f"admin {scheme}://{host}:{cloud.http_port}/admin  (Ctrl-C to stop; replicas keep running)"
        )
        if cloud.admin_key is not None:
            console.print(
                f"admin API key (shown once; also in {state_dir / 'admin.key'}, mode 0600):\n  {cloud.admin_key}",
                soft_wrap=True,
            )
        await cloud.serve_forever()

    from octacloud.protocols.server import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def _print_fleet_summary(cloud: Any) -> None:
    table = Table(title="fleet")
    for col in ("node", "cards", "model", "memory MiB/card", "CPU cores"):
        table.add_column(col)
    for n in cloud.nodes:
        card_memory = str(n.gpus[0].memory_mib if n.gpus else 0)
        table.add_row(n.name, str(n.gpu_count), n.gpu_model, card_memory, str(n.cpu_milli // 1000))
    console.print(table)


def deploy(
    model: str = typer.Argument(..., help="Model name in the repository."),
    name: str | None = typer.Option(None, "--name", help="Deployment name (default: the model's)."),
    version: str = typer.Option("", "--version", help="Model version (default: latest)."),
    octants: str = typer.Option(
        "1", "--octants", help="Octants per replica (1-8; multiples of 8: whole cards) or auto."
    ),
    min_replicas: int = typer.Option(1, "--min-replicas"),
    max_replicas: int | None = typer.Option(None, "--max-replicas"),
    target_qps: float | None = typer.Option(None, "--target-qps"),
    slo_ms: float | None = typer.Option(None, "--slo-ms"),
    priority: int = typer.Option(0, "--priority"),
    tenant: str | None = typer.Option(None, "--tenant", help="Owner (admin keys only; default: the key's)."),
    publish: bool = typer.Option(False, "--publish", help="Let every tenant infer on it."),
    url: str | None = typer.Option(None, "--url"),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Deploy (or update) a model."""
    if octants != "auto" and not octants.isdigit():
        err.print(f"[red]error:[/] --octants must be a whole number or 'auto', got {octants!r}")
        raise typer.Exit(2)
    body = {
        "name": name or model,
        "model": model,
        "version": version,
        "octants": None if octants == "auto" else int(octants),
        "min_replicas": min_replicas,
        "max_replicas": max(min_replicas, 1) if max_replicas is None else max_replicas,
        "target_qps": target_qps,
        "slo_ms": slo_ms,
        "priority": priority,
        "published": publish,
    }
    if tenant is not None:
        body["tenant"] = tenant
    data = _call("POST", _url(url), "/admin/deployments", body, key, cacert)
    spec = data["spec"]
    console.print(f"deployed [bold]{spec['name']}[/]: {data['replicas']} replica(s) × {data['octants']} octant(s)")


def status(
    url: str | None = typer.Option(None, "--url"),
    as_json: bool = typer.Option(False, "--json"),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Deployments and their replicas: where each runs and in what state."""
    data = _call("GET", _url(url), "/admin/deployments", None, key, cacert)
    if as_json:
        console.print_json(json.dumps(data))
        return
    table = Table(title="deployments")
    for col in ("deployment", "model", "want", "octants", "replica", "state", "node", "cards", "milli", "message"):
        table.add_column(col)
    for d in data["deployments"]:
        spec = d["spec"]
        rows = d["instances"] or [{}]
        for r in rows:
            table.add_row(
                spec["name"],
                spec["model"],
                str(d["replicas"]),
                str(d["octants"]),
                r.get("id", "-"),
                r.get("state", "-"),
                r.get("node", "") or "-",
                ",".join(map(str, r.get("gpus", []))) or "-",
                str(r.get("milli_per_gpu", "")),
                r.get("message", ""),
            )
    console.print(table)


def scale(
    name: str = typer.Argument(...),
    replicas: int = typer.Argument(...),
    url: str | None = typer.Option(None, "--url"),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Set a deployment's replica count."""
    data = _call("POST", _url(url), f"/admin/deployments/{name}/scale", {"replicas": replicas}, key, cacert)
    console.print(f"{name}: {data['replicas']} replica(s)")


def undeploy(
    name: str = typer.Argument(...),
    url: str | None = typer.Option(None, "--url"),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Remove a deployment and stop its replicas (their slices return to the pool)."""
    _call("DELETE", _url(url), f"/admin/deployments/{name}", None, key, cacert)
    console.print(f"undeployed {name}")


def events(
    url: str | None = typer.Option(None, "--url"),
    limit: int = typer.Option(30, "--limit"),
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Recent controller events (placements, failures, restarts, preemptions)."""
    data = _call("GET", _url(url), f"/admin/events?limit={limit}", None, key, cacert)
    table = Table(title="events")
    for col in ("kind", "subject", "message"):
        table.add_column(col)
    for e in reversed(data["events"]):
        table.add_row(e["kind"], e["subject"], e["message"])
    console.print(table)


def down(
    state_dir: Path = typer.Option(Path("var"), "--state-dir", help="The state dir `octacloud up` used."),
    grace: float = typer.Option(5.0, "--grace", help="Seconds a replica gets to finish before it is killed."),
) -> None:
    """Stop the local replicas a stopped `octacloud up` left running. Deployments stay: the next `up` starts
    them again. (While `up` runs, use `undeploy` or `scale` instead.)"""
    from octacloud.cluster.launcher import LocalProcessLauncher
    from octacloud.cluster.store import StateStore

    db = state_dir / "octacloud.db"
    if not db.exists():
        err.print(f"[red]error:[/] no octacloud state in {state_dir} (give the --state-dir `octacloud up` used)")
        raise typer.Exit(2)
    store = StateStore.at(db)
    launcher = LocalProcessLauncher(state_dir / "replicas")
    stopped = 0
    for r in store.replicas():
        if r.handle and r.handle.isdigit() and launcher.alive(r.handle):
            launcher.stop(r.handle, grace)
            stopped += 1
    store.close()
    console.print(f"stopped {stopped} replica(s) of {state_dir}")


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
    app.command()(deploy)
    app.command()(status)
    app.command()(scale)
    app.command()(undeploy)
    app.command()(events)
