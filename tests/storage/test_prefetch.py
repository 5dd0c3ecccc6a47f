"""Prefetch and warm copies: a model fetched into a node's cache ahead of the replica that will need it (one
waiting for its slice, a warm copy for the failover reserve), never twice at once."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from octacloud.control.launcher import LocalProcessLauncher, StoreFetch
from octacloud.control.warm import warm_copy_nodes, warm_once
from octacloud.core import Gpu, Node
from octacloud.core.model import Health
from octacloud.scheduler.framework import ClusterState
from octacloud.storage.cache import NodeCache
from octacloud.storage.store import FsspecStore
from tests.storage.conftest import write_version


def test_a_prefetch_fills_the_node_cache_in_the_background_once(tmp_path: Path) -> None:
    write_version(tmp_path / "store", "mlp", 1, b"w" * 2**20)
    fetch = StoreFetch(FsspecStore(str(tmp_path / "store")), tmp_path / "cache")
    launcher = LocalProcessLauncher(tmp_path / "replicas", fetch=fetch)
    launcher.prefetch("node-a", "mlp", "")
    launcher.prefetch("node-a", "mlp", "")  # under way (or done): not repeated while in flight
    deadline = time.monotonic() + 60
    while not launcher.prefetched and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.prefetched[:1] == [("node-a", "mlp")]
    assert NodeCache(tmp_path / "cache").cached_versions("mlp") == [1]
    assert LocalProcessLauncher(tmp_path / "r2").prefetch("node-a", "mlp", "") is None  # no store: nothing to do


@pytest.mark.parametrize(
    ("free", "running", "copies", "chosen"),
    [
        ({"a": 1000, "b": 8000, "c": 4000}, {"a"}, 1, ["b"]),  # where the reserve is
        ({"a": 1000, "b": 8000, "c": 4000}, {"b"}, 2, ["c", "a"]),
        ({"a": 5000, "b": 5000}, set(), 1, ["a"]),  # ties by name
        ({"a": 5000}, {"a"}, 3, []),  # nowhere else
        ({"a": 5000, "b": 0}, set(), 0, []),  # off
    ],
)
def test_warm_copies_go_where_a_failover_would_land(
    free: dict[str, int], running: set[str], copies: int, chosen: list[str]
) -> None:
    assert warm_copy_nodes(free, running, copies) == chosen


def test_warm_once_prefetches_each_deployment_to_its_spare_nodes_only() -> None:
    nodes = [Node(n, 8000, 65536, (Gpu(0, "T4", 16_000),)) for n in ("a", "b", "c")]
    state = ClusterState(nodes)
    state.set_node_health("c", Health.FAILED)  # a failed node gets no warm copy
    asked: list[tuple[str, str, str]] = []
    deployment = SimpleNamespace(spec=SimpleNamespace(model="mlp", version="2"))
    controller = SimpleNamespace(
        scheduler=SimpleNamespace(state=state),
        status=lambda: [(deployment, [SimpleNamespace(node="a")])],
        prefetch=lambda *args: asked.append(args),
    )
    warm_once(controller, 2)  # type: ignore[arg-type]
    assert asked == [("b", "mlp", "2")]
