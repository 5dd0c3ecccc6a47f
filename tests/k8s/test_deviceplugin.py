"""The device plugin against a kubelet that speaks the upstream v1beta1 api.proto over unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from octacloud.control.slices import Slice, slice_environment
from octacloud.core.model import Gpu, Health, Node, Placement
from octacloud.k8s.api import KubeClient
from octacloud.k8s.deviceplugin import DevicePlugin, NvmlHealth, StaticHealth, node_from_nvml
from octacloud.k8s.fakeapi import FakeApiServer
from octacloud.k8s.plugin_server import PluginServer
from octacloud.k8s.resources import GPUS, OCTANTS, placement_annotations
from octacloud.observability.dcgm import NvmlCards

from ..observability.fakes import FakeCard, FakeNvml
from .kubelet import FakeKubelet
from .wire import pod

NODE = Node("a100-1", 32_000, 262_144, tuple(Gpu(i, "A100", 81_920) for i in range(4)))


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dp-") as d:  # short: unix socket paths are limited to 107 bytes
        yield Path(d)


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    await k.start()
    yield k
    await k.stop()


async def serve(server: PluginServer) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    return stop, task


async def test_registers_and_advertises_octants_per_card(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        plugin = await kubelet.wait(OCTANTS)
        (reg,) = kubelet.registrations
        assert (reg.version, reg.resource_name, reg.endpoint) == ("v1beta1", OCTANTS, "octacloud-octants.sock")
        assert reg.options.get_preferred_allocation_available and not reg.options.pre_start_required
        assert len(plugin.devices) == 32
        assert set(plugin.devices) == {f"gpu{g}-octant{k}" for g in range(4) for k in range(8)}
        assert set(plugin.devices.values()) == {"Healthy"}
    finally:
        stop.set()
        await task


async def test_whole_cards_resource(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, GPUS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        plugin = await kubelet.wait(GPUS)
        assert sorted(plugin.devices) == ["gpu0", "gpu1", "gpu2", "gpu3"]
        ids, response = await kubelet.admit(GPUS, 2)
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(i[3:] for i in ids)
        assert response.envs["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in response.envs and not response.mounts
    finally:
        stop.set()
        await task


async def test_health_from_nvml_reaches_list_and_watch(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    nvml = FakeNvml([FakeCard(uuid=f"GPU-{i}", bus_id=f"0000:{i:02x}:00.0") for i in range(2)])
    cards = NvmlCards(nvml)
    node = node_from_nvml(cards, "h100-1", 16_000, 131_072, now=0.0)
    assert [g.model for g in node.gpus] == ["H100-80GB-HBM3"] * 2 and node.gpus[0].memory_mib == 81_920
    server = PluginServer(DevicePlugin(node, OCTANTS, NvmlHealth(cards, lambda: 1.0)), plugin_dir, poll_s=0.05)
    published: list[list[Health]] = []

    async def publish(health: list[Health]) -> None:
        published.append(health)

    server.on_health = publish
    stop, task = await serve(server)
    try:
        plugin = await kubelet.wait(OCTANTS)
        assert set(plugin.devices.values()) == {"Healthy"}
        nvml.cards[1].ecc = (3, 2)  # uncorrected ECC errors on card 1
        plugin = await kubelet.wait(OCTANTS, updates=2)
        assert {d for d, h in plugin.devices.items() if h == "Unhealthy"} == {f"gpu1-octant{k}" for k in range(8)}
        assert published == [[Health.HEALTHY, Health.FAILED]]
        nvml.cards[0].ecc = (0, 0)
        nvml.xid(0, 79)  # fallen off the bus
        plugin = await kubelet.wait(OCTANTS, updates=3)
        assert set(plugin.devices.values()) == {"Unhealthy"}
    finally:
        stop.set()
        await task


async def test_preferred_allocation_keeps_a_container_on_one_card(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        await kubelet.wait(OCTANTS)
        first, _ = await kubelet.admit(OCTANTS, 3)
        assert len({d.split("-")[0] for d in first}) == 1
        for size in (6, 5, 2, 8, 1):
            ids, response = await kubelet.admit(OCTANTS, size)
            cards = {d.split("-")[0] for d in ids}
            assert len(ids) == size and len(cards) == 1, ids
            assert response.envs["OCTACLOUD_OCTANTS"] == str(size)
        # the 5 went next to the 3 (fullest card that fits), not on a fresh card
        plugin = kubelet.plugins[OCTANTS]
        used = {g: sum(1 for d in plugin.allocated if d.startswith(f"gpu{g}-")) for g in range(4)}
        assert sorted(used.values(), reverse=True)[:3] == [8, 8, 8]
    finally:
        stop.set()
        await task


async def test_allocate_gives_the_extenders_card_and_mps_limits(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server_api = FakeApiServer()
    p = pod("share", 3, node_name="a100-1")
    p["metadata"]["annotations"] = placement_annotations(Placement(p["metadata"]["uid"], "a100-1", (2,), 375))
    server_api.put("/api/v1", "pods", p)
    api = KubeClient("https://k8s", transport=server_api.transport)
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE), api=api), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        await kubelet.wait(OCTANTS)
        ids, response = await kubelet.admit(OCTANTS, 3)
        assert {d.split("-")[0] for d in ids} == {"gpu2"}  # preferred: the extender's card
        expected = slice_environment(NODE, Slice("a100-1", (2,), 375))
        env = dict(response.envs)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == expected["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == expected["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/octacloud/mps"
        (mount,) = response.mounts
        assert (mount.host_path, mount.container_path) == ("/var/run/octacloud/mps", "/var/run/octacloud/mps")
        stored = server_api.get("/api/v1", "pods", "default", "share")
        assert stored["metadata"]["annotations"]["octacloud.io/allocated"] == OCTANTS
        # the next container of that size has no pending pod: its slice comes from the device IDs
        ids2, response2 = await kubelet.admit(OCTANTS, 3)
        assert response2.envs["NVIDIA_VISIBLE_DEVICES"] == ids2[0].split("-")[0][3:]
    finally:
        stop.set()
        await task
        await api.close()


async def test_bad_allocations_are_refused(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        plugin = await kubelet.wait(OCTANTS)
        from octacloud.k8s.v1beta1 import api_pb2 as pb

        for ids, message in ((["gpu9-octant0"], "has no card 9"), (["nvidia0"], "not one of octacloud's"), ([], "no")):
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await plugin.stub.Allocate(request)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and message in (err.value.details() or "")
        ids, _ = await kubelet.admit(OCTANTS, 1)  # still serving
        assert len(ids) == 1
    finally:
        stop.set()
        await task


async def test_reregisters_after_a_kubelet_restart(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    try:
        await kubelet.wait(OCTANTS)
        server.socket.unlink()  # kubelet wipes the plugin directory when it starts
        for _ in range(200):
            if len(kubelet.registrations) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(kubelet.registrations) == 2 and server.socket.exists()
        await kubelet.wait(OCTANTS)
        ids, _ = await kubelet.admit(OCTANTS, 2)
        assert len(ids) == 2
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_waits_for_a_kubelet_that_starts_later(plugin_dir: Path) -> None:
    server = PluginServer(DevicePlugin(NODE, OCTANTS, StaticHealth(NODE)), plugin_dir, poll_s=0.05)
    stop, task = await serve(server)
    kubelet = FakeKubelet(plugin_dir)
    try:
        await asyncio.sleep(0.3)  # several failed registrations: the plugin keeps serving and retrying
        assert not task.done() and server.registrations == 0
        await kubelet.start()
        plugin = await kubelet.wait(OCTANTS)
        assert len(plugin.devices) == 32 and server.registrations == 1
    finally:
        stop.set()
        await task
        await kubelet.stop()
