"""``octacloud node start``: make this server a node of an octacloud cluster on Ray.

Runs ``ray start`` so that the Ray node advertises this server's inventory as resources octacloud's scheduler
pins replicas to: one ``gpu<i>_octant: 8`` resource per card, an ``octacloud_node:<name>`` marker, and the card
model, memory and NVLink groups as labels. The inventory comes from NVML (NVIDIA GPUs), or from a fleet file
(``--fleet FILE --fleet-node NAME``) for CPU-only or test nodes, or is this host's CPU as ``--cpu-cards`` cards.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

node_app = typer.Typer(help="Start or join the Ray cluster the cloud runs on.", no_args_is_help=True)
_err = Console(stderr=True, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        _err.print("[red]error:[/] the `ray` command is not installed (pip install 'ray==2.*')")
        raise typer.Exit(2)
    return found


def _start(
    head: bool,
    address: str | None,
    fleet: Path | None,
    fleet_node: str | None,
    name: str | None,
    cpu_cards: int,
    port: int,
    node_ip: str | None,
    block: bool,
    dry_run: bool,
) -> None:
    from octacloud.control.fleet import discover_fleet, load_fleet_file
    from octacloud.control.ray.inventory import FAST_FAILURE_DETECTION, ray_start_command
    from octacloud.core.errors import OctacloudError

    try:
        if fleet is not None:
            nodes = load_fleet_file(fleet)
            if fleet_node is None and len(nodes) != 1:
                raise typer.BadParameter("the fleet file has several nodes: say which with --fleet-node")
            chosen = [n for n in nodes if fleet_node is None or n.name == fleet_node]
            if not chosen:
                raise typer.BadParameter(f"no node {fleet_node!r} in {fleet}; it has {[n.name for n in nodes]}")
            node = chosen[0]
        else:
            node = discover_fleet(cpu_cards=cpu_cards)[0]
        if name is not None:
            from dataclasses import replace

            node = replace(node, name=name)
        argv = ray_start_command(
            node,
            ray=_ray_executable(),
            head=head,
            address=address,
            port=port,
            node_ip=node_ip,
            system_config=FAST_FAILURE_DETECTION,
            block=block,
        )
    except OctacloudError as exc:
        _err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    _err.print(f"octacloud node {node.name}: {node.gpu_count} × {node.gpu_model or 'no card'}, "
               f"{node.cpu_milli // 1000} CPU")  # fmt: skip
    print(shlex.join(argv))
    if dry_run:
        return
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    os.execve(argv[0], argv, env)


# The options `node start` and `node join` share.
FLEET: Any = typer.Option(None, "--fleet", help="Fleet file declaring this node (CPU-only, tests).")
FLEET_NODE: Any = typer.Option(None, "--fleet-node", help="Which node of the fleet file this is.")
NAME: Any = typer.Option(None, "--name", help="Node name (default: from the fleet file or hostname).")
CPU_CARDS: Any = typer.Option(1, "--cpu-cards", help="Without GPUs or a fleet file: CPU 'cards' to offer.")
NODE_IP: Any = typer.Option(None, "--node-ip-address", help="This server's address in the cluster.")
BLOCK: Any = typer.Option(False, "--block", help="Stay in the foreground (for systemd or a container).")
DRY_RUN: Any = typer.Option(False, "--dry-run", help="Print the `ray start` command and do nothing.")


@node_app.command("start")
def start(
    head: bool = typer.Option(False, "--head", help="Start a new cluster with this server as its head."),
    address: str | None = typer.Option(None, "--address", help="Join the cluster whose head is at HOST:PORT."),
    fleet: Path | None = FLEET,
    fleet_node: str | None = FLEET_NODE,
    name: str | None = NAME,
    cpu_cards: int = CPU_CARDS,
    port: int = typer.Option(6379, "--port", help="The head's port (with --head)."),
    node_ip: str | None = NODE_IP,
    block: bool = BLOCK,
    dry_run: bool = DRY_RUN,
) -> None:
    """Start (--head) or join (--address) the Ray cluster, advertising this server's cards as octants."""
    _start(head, address, fleet, fleet_node, name, cpu_cards, port, node_ip, block, dry_run)


@node_app.command("join")
def join(
    address: str = typer.Argument(..., help="The head's HOST:PORT."),
    fleet: Path | None = FLEET,
    fleet_node: str | None = FLEET_NODE,
    name: str | None = NAME,
    cpu_cards: int = CPU_CARDS,
    node_ip: str | None = NODE_IP,
    block: bool = BLOCK,
    dry_run: bool = DRY_RUN,
) -> None:
    """Join the cluster at ADDRESS (the same as ``node start --address ADDRESS``)."""
    _start(False, address, fleet, fleet_node, name, cpu_cards, 6379, node_ip, block, dry_run)
