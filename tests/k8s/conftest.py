from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from octacloud.core.clock import ManualClock
from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import KubeClient
from octacloud.k8s.extender import Extender
from octacloud.k8s.extender_http import build_extender_app
from octacloud.k8s.fakeapi import FakeApiServer
from octacloud.scheduler.policies import cloud_profile

from .cluster import ControlPlane, start_control_plane
from .wire import node_obj


def fleet() -> list[Node]:
    """Mixed fleet: two 8×A100 NVLink nodes, a 4×T4 node, a CPU-only node."""

    def cards(n: int, model: str, mib: int, nvlink: bool) -> tuple[Gpu, ...]:
        return tuple(Gpu(i, model, mib, (i // 4) if nvlink else None) for i in range(n))

    return [
        Node("a100-1", 96_000, 1_048_576, cards(8, "A100", 81_920, True)),
        Node("a100-2", 96_000, 1_048_576, cards(8, "A100", 81_920, True)),
        Node("t4-1", 32_000, 262_144, cards(4, "T4", 16_384, False)),
        Node("cpu-1", 16_000, 65_536),
    ]


@pytest.fixture
def api_server() -> FakeApiServer:
    server = FakeApiServer()
    for n in fleet():
        server.put("/api/v1", "nodes", node_obj(n))
    return server


@pytest.fixture
async def api(api_server: FakeApiServer) -> AsyncIterator[KubeClient]:
    client = KubeClient("https://kubernetes.default.svc", token="t0ken", transport=api_server.transport)
    yield client
    await client.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def extender(api: KubeClient, clock: ManualClock) -> Extender:
    ext = Extender(fleet(), cloud_profile(), api=api, clock=clock)
    await ext.resync()
    return ext


@pytest.fixture
async def http(extender: Extender) -> AsyncIterator[httpx.AsyncClient]:
    app = build_extender_app(extender)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender") as client:
        yield client


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One real control plane for the whole session (etcd, kube-apiserver, kube-controller-manager), with two
    kube-schedulers running ``deploy/k8s/config/scheduler-config.yaml``: profile ``octacloud`` as shipped
    (nodeCacheCapable) and ``octacloud-nodes`` with node objects sent to the extender."""
    cp = start_control_plane(tmp_path_factory.mktemp("k8s"))
    try:
        cp.scheduler("octacloud", cp.scheduler_config("octacloud"))
        cp.scheduler("octacloud-nodes", cp.scheduler_config("octacloud-nodes", node_cache=False))
        yield cp
    finally:
        cp.stop()
