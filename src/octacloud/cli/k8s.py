"""``octacloud k8s``: the scheduler extender, the device plugin and the operator for Kubernetes clusters."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from octacloud.core.errors import InvalidSpecError

if TYPE_CHECKING:
    from octacloud.core.model import Node
    from octacloud.k8s.api import KubeClient
    from octacloud.k8s.deviceplugin import HealthSource

k8s_app = typer.Typer(help="Run octacloud's parts on a Kubernetes cluster.", no_args_is_help=True)

API_SERVER = typer.Option(None, "--api-server", help="API server URL (default: in-cluster service account).")
TOKEN_FILE = typer.Option(None, "--token-file", help="Bearer token file (with --api-server).")
CA_FILE = typer.Option(None, "--ca-file", help="CA bundle of the API server (with --api-server).")


def register(app: typer.Typer) -> None:
    app.add_typer(k8s_app, name="k8s")


def _fail(exc: Exception) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(2)


def _client(api_server: str | None, token_file: Path | None, ca_file: Path | None) -> KubeClient:
    from octacloud.k8s.api import KubeClient

    if api_server is None:
        return KubeClient.in_cluster()
    token = token_file.read_text().strip() if token_file is not None else None
    return KubeClient(api_server, token=token, verify=str(ca_file) if ca_file is not None else True)


async def _until_signalled(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def _log_to_stderr() -> None:
    """The three long-running k8s processes log one timestamped line per event, as their containers' logs."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


@k8s_app.command("extender")
def extender(
    host: str = typer.Option("127.0.0.1", help="Address to bind (kube-scheduler's urlPrefix points here)."),
    port: int = typer.Option(8888, help="Port to bind."),
    policy: str = typer.Option("octacloud", help="Scheduling profile (as `octacloud up --policy`)."),
    fleet: Path | None = typer.Option(None, "--fleet", help="Fleet file (default: the nodes octacloud labelled)."),
    resync: float = typer.Option(10.0, help="Seconds between rebuilds of the state from the API's pods."),
    no_api: bool = typer.Option(False, "--no-api", help="Run without the API (filter/prioritize only; needs --fleet)."),
    api_server: str | None = API_SERVER,
    token_file: Path | None = TOKEN_FILE,
    ca_file: Path | None = CA_FILE,
) -> None:
    """kube-scheduler's HTTP extender (filter, prioritize, bind, preempt) answered by octacloud's scheduler."""
    from octacloud.control.fleet import load_fleet_file
    from octacloud.k8s.extender import Extender, ExtenderSettings
    from octacloud.k8s.extender_http import serve_extender
    from octacloud.protocols.server import new_event_loop
    from octacloud.scheduler.policies import cloud_profile

    _log_to_stderr()
    try:
        if resync <= 0:
            raise InvalidSpecError(f"--resync must be > 0 seconds, got {resync}")
        if no_api and fleet is None:
            raise InvalidSpecError("--no-api needs --fleet: without the API the extender cannot learn the nodes")
        nodes = load_fleet_file(fleet) if fleet is not None else []
        api = None if no_api else _client(api_server, token_file, ca_file)
        ext = Extender(
            nodes, cloud_profile(policy), api=api, settings=ExtenderSettings(resync_s=resync), fixed_fleet=bool(fleet)
        )
    except InvalidSpecError as exc:
        raise _fail(exc) from None

    async def main() -> None:
        stop = asyncio.Event()
        await _until_signalled(stop)
        try:
            await serve_extender(ext, host, port, stop)
        finally:
            if api is not None:
                await api.close()

    typer.echo(f"octacloud extender on http://{host}:{port} (policy {policy})")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


@k8s_app.command("device-plugin")
def device_plugin(
    node_name: str = typer.Option(
        os.environ.get("NODE_NAME") or socket.gethostname(), "--node-name", help="This node's name ($NODE_NAME)."
    ),
    resources: str = typer.Option("octants,gpus", help="Resources to serve: octants, gpus or both."),
    plugin_dir: Path = typer.Option(Path("/var/lib/kubelet/device-plugins"), help="kubelet's device plugin folder."),
    fleet: Path | None = typer.Option(None, "--fleet", help="Describe this node by a fleet file instead of NVML."),
    mps_pipe_dir: str = typer.Option("/var/run/octacloud/mps", help="Host folder of the MPS control daemon's pipes."),
    no_api: bool = typer.Option(False, "--no-api", help="Do not label the node nor read pods (slices from IDs)."),
    api_server: str | None = API_SERVER,
    token_file: Path | None = TOKEN_FILE,
    ca_file: Path | None = CA_FILE,
) -> None:
    """kubelet's device plugin: this node's octants (and whole cards), their health, the slice environment."""
    from octacloud.core.model import Health
    from octacloud.k8s.deviceplugin import DevicePlugin, publish_node
    from octacloud.k8s.plugin_server import PluginServer
    from octacloud.k8s.resources import GPUS, OCTANTS
    from octacloud.protocols.server import new_event_loop

    _log_to_stderr()
    wanted = {"octants": OCTANTS, "gpus": GPUS}
    try:
        names = [r.strip() for r in resources.split(",") if r.strip()]
        bad = [r for r in names if r not in wanted]
        if bad or not names:
            raise InvalidSpecError(f"--resources: expected octants and/or gpus, got {resources!r}")
        node, health, card_ids = _this_node(fleet, node_name)
        api = None if no_api else _client(api_server, token_file, ca_file)
    except InvalidSpecError as exc:
        raise _fail(exc) from None

    async def main() -> None:
        stop = asyncio.Event()
        await _until_signalled(stop)
        servers = []
        for r in names:
            plugin = DevicePlugin(node, wanted[r], health, api=api, mps_pipe_host_dir=mps_pipe_dir, card_ids=card_ids)
            servers.append(PluginServer(plugin, plugin_dir))
        if api is not None:
            await publish_node(api, node, [g.health for g in node.gpus])

            async def publish(h: list[Health]) -> None:
                assert api is not None
                await publish_node(api, node, h)

            servers[0].on_health = publish
        try:
            await asyncio.gather(*(s.run(stop) for s in servers))
        finally:
            if api is not None:
                await api.close()

    typer.echo(f"octacloud device plugin for {node_name}: {node.gpu_count} card(s), serving {', '.join(names)}")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def _this_node(fleet: Path | None, node_name: str) -> tuple[Node, HealthSource, list[str]]:
    """This node, where its cards' health comes from, and their NVML ids: from the fleet file when given (health
    as the file says), else from NVML."""
    from octacloud.control.fleet import load_fleet_file
    from octacloud.k8s.deviceplugin import NvmlHealth, StaticHealth, node_from_nvml
    from octacloud.observability.dcgm import NvmlCards, open_nvml

    if fleet is not None:
        matches = [n for n in load_fleet_file(fleet) if n.name == node_name]
        if not matches:
            raise InvalidSpecError(f"{fleet}: no node named {node_name!r} (give --node-name)")
        return matches[0], StaticHealth(matches[0]), []
    nvml = open_nvml()
    if nvml is None:
        raise InvalidSpecError("no NVIDIA GPUs found through NVML; describe this node with --fleet")
    cards = NvmlCards(nvml)
    node = node_from_nvml(cards, node_name, (os.cpu_count() or 1) * 1000, 0, 0.0)
    return node, NvmlHealth(cards, lambda: asyncio.get_running_loop().time()), [c.uuid for c in cards.cards]


@k8s_app.command("operator")
def operator(
    repository: Path | None = typer.Option(None, "--repository", help="Model repository (sizes octants 'auto')."),
    namespace: list[str] = typer.Option([], "--namespace", help="Watch these namespaces (default: all)."),
    api_server: str | None = API_SERVER,
    token_file: Path | None = TOKEN_FILE,
    ca_file: Path | None = CA_FILE,
) -> None:
    """The InferenceDeployment operator (kopf): deployments as custom resources."""
    import kopf

    from octacloud.control.probes import RepositoryFootprints
    from octacloud.k8s.operator import register_handlers

    _log_to_stderr()
    try:
        _client(api_server, token_file, ca_file)  # fail early with a clear message outside a cluster
    except InvalidSpecError as exc:
        raise _fail(exc) from None
    footprint = RepositoryFootprints(repository) if repository is not None else None
    register_handlers(lambda: _client(api_server, token_file, ca_file), footprint)
    kopf.run(standalone=True, clusterwide=not namespace, namespaces=namespace)
