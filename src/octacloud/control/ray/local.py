"""A Ray cluster of several octacloud nodes on this one machine: for tests, benchmarks and trying things out.

Each fleet node becomes a Ray node (its own raylet, object store and workers) that advertises the node's
inventory exactly as ``octacloud node start`` would on a real server, so the cloud cannot tell the
difference. Run it where Ray binds 127.0.0.1 only: inside a loopback-only network namespace
(``scripts/netns-run``), since Ray otherwise advertises the machine's interface address.

Everything started here is stopped here, by PID (:meth:`LocalRayCluster.kill_node` kills one node's raylet
to simulate a server dying; :meth:`LocalRayCluster.shutdown` stops all): never ``ray stop``, which would stop
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


class LocalRayCluster:
    """``nodes`` as a Ray cluster on this machine; the first is the head. Connects this process as driver."""

    def __init__(self, nodes: list[Node], temp_dir: Path | None = None) -> None:
        if not nodes:
            raise ValueError("a Ray cluster needs at least one node")
        for key, value in {**QUIET_ENVIRONMENT, "RAY_AUTH_MODE": "disabled"}.items():
            os.environ.setdefault(key, value)
        if temp_dir is not None:  # Ray's socket paths must stay short: keep this near the root
            temp_dir.mkdir(parents=True, exist_ok=True)
            os.environ["RAY_TMPDIR"] = str(temp_dir)
        self.nodes = list(nodes)
        head = {**node_args(nodes[0]), "_system_config": dict(FAST_FAILURE_DETECTION)}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._ray_nodes: dict[str, Any] = {nodes[0].name: self.cluster.head_node}
        try:
            for node in nodes[1:]:
                self._ray_nodes[node.name] = self.cluster.add_node(**node_args(node))
            self.cluster.wait_for_nodes()
            connect(self.cluster.address)
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def raylet_pid(self, name: str) -> int:
        """The PID of node ``name``'s raylet."""
        try:
            ray_node = self._ray_nodes[name]
        except KeyError:
            raise NotFoundError(f"no node {name!r} in this cluster; nodes: {sorted(self._ray_nodes)}") from None
        return int(ray_node.all_processes["raylet"][0].process.pid)

    def kill_node(self, name: str) -> int:
        """Kill node ``name``'s raylet with SIGKILL, as if the server died; returns the PID killed."""
        pid = self.raylet_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

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
