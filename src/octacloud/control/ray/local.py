"""A Ray cluster of several octacloud nodes on this one machine: for tests, benchmarks and trying things out.

Each fleet node becomes a Ray node (its own raylet, object store and workers) that advertises the node's
inventory exactly as ``octacloud node start`` would on a real server, so the cloud cannot tell the
difference. Run it where Ray binds 127.0.0.1 only: inside a loopback-only network namespace
(``scripts/netns-run``), since Ray otherwise advertises the machine's interface address.

Everything started here is stopped here, by PID (:meth:`LocalRayCluster.kill_node` kills one node's raylet
to simulate a server dying, :meth:`LocalRayCluster.kill_nodes` every process of several nodes at once, as a
rack that loses power; :meth:`LocalRayCluster.shutdown` stops all): never ``ray stop``, which would stop
every Ray process on the machine, other people's included.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import TracebackType
from typing import Any

from ray.cluster_utils import Cluster

import ray
from octacloud.control.ray.backend import FAST_FAILURE_DETECTION, QUIET_ENVIRONMENT, connect
from octacloud.control.ray.inventory import node_labels, node_resources
from octacloud.core.errors import NotFoundError
from octacloud.core.model import Node

OBJECT_STORE_BYTES = 80 * 2**20
"""Per node: replicas pass no objects through Ray (the gateway calls them over HTTP/gRPC)."""


def node_args(node: Node) -> dict[str, Any]:
    """``ray.cluster_utils.Cluster.add_node`` arguments for one fleet node."""
    return {
        "num_cpus": max(1, node.cpu_milli // 1000),
        "num_gpus": 0,
        "resources": node_resources(node),
        "labels": node_labels(node),
        "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False,
    }


BARE_HEAD: dict[str, Any] = {
    "num_cpus": 1,
    "num_gpus": 0,
    "object_store_memory": OBJECT_STORE_BYTES,
    "include_dashboard": False,
}
"""A head node that is no octacloud node: Ray's GCS and a driver's node, no cards."""


def descendants(roots: list[int]) -> list[int]:
    """The PIDs of every process below ``roots`` in the process tree (children first, then theirs), from
    ``/proc``; processes that end while it reads are skipped."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces or ')'
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    queue = list(roots)
    while queue:
        for child in sorted(children.get(queue.pop(0), [])):
            if child not in found:
                found.append(child)
                queue.append(child)
    return found


class LocalRayCluster:
    """``nodes`` as a Ray cluster on this machine; the first is the head, or (``bare_head``) the head is a Ray
    node of its own that advertises no octacloud node (the cluster's GCS, as an operator would run it apart from
    the servers), so that every fleet node can be lost. Connects this process as driver."""

    def __init__(self, nodes: list[Node], temp_dir: Path | None = None, bare_head: bool = False) -> None:
        if not nodes:
            raise ValueError("a Ray cluster needs at least one node")
        for key, value in {**QUIET_ENVIRONMENT, "RAY_AUTH_MODE": "disabled"}.items():
            os.environ.setdefault(key, value)
        if temp_dir is not None:  # Ray's socket paths must stay short: keep this near the root
            temp_dir.mkdir(parents=True, exist_ok=True)
            os.environ["RAY_TMPDIR"] = str(temp_dir)
        self.nodes = list(nodes)
        workers = nodes if bare_head else nodes[1:]
        head = {**(BARE_HEAD if bare_head else node_args(nodes[0])), "_system_config": dict(FAST_FAILURE_DETECTION)}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._ray_nodes: dict[str, Any] = {} if bare_head else {nodes[0].name: self.cluster.head_node}
        try:
            for node in workers:
                self._ray_nodes[node.name] = self.cluster.add_node(**node_args(node))
            self.cluster.wait_for_nodes()
            connect(self.cluster.address)
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def _ray_node(self, name: str) -> Any:
        try:
            return self._ray_nodes[name]
        except KeyError:
            raise NotFoundError(f"no node {name!r} in this cluster; nodes: {sorted(self._ray_nodes)}") from None

    def raylet_pid(self, name: str) -> int:
        """The PID of node ``name``'s raylet."""
        return int(self._ray_node(name).all_processes["raylet"][0].process.pid)

    def node_pids(self, name: str) -> list[int]:
        """Every process of node ``name``: those Ray started for it (its raylet first) and all they started in
        turn (its workers, the replicas' actors among them, and agents), read from ``/proc``."""
        started = self._ray_node(name).all_processes
        roots = [int(p.process.pid) for kind in sorted(started, key=lambda k: k != "raylet") for p in started[kind]]
        return roots + [pid for pid in descendants(roots) if pid not in roots]

    def kill_node(self, name: str) -> int:
        """Kill node ``name``'s raylet with SIGKILL, as if the server died; returns the PID killed."""
        pid = self.raylet_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_nodes(self, names: list[str]) -> list[int]:
        """Kill every process of nodes ``names`` with SIGKILL at once, as if their rack lost power; returns the
        PIDs killed. All are found before the first is killed (a worker whose raylet died is re-parented)."""
        pids = [pid for name in names for pid in self.node_pids(name)]
        killed = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended on its own meanwhile
                continue
            killed.append(pid)
        return killed

    def add_node(self, node: Node) -> None:
        """A new server joins (or a lost one comes back under the same name)."""
        self._ray_nodes[node.name] = self.cluster.add_node(**node_args(node))
        self.nodes.append(node)

    def shutdown(self) -> None:
        """Disconnect and stop every process this cluster started (by PID, through Ray's node objects)."""
        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()  # type: ignore[no-untyped-call]

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()
