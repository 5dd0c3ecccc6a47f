"""A kubelet device manager for tests: serves ``Registration`` on ``kubelet.sock`` and drives registered plugins
over their sockets the way kubelet does (ListAndWatch, then GetPreferredAllocation and Allocate on admission),
speaking the generated stubs of the upstream ``api.proto``."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from octacloud.k8s.v1beta1 import api_pb2 as pb
from octacloud.k8s.v1beta1 import api_pb2_grpc as pb_grpc


@dataclass
class Plugin:
    resource: str
    endpoint: str
    channel: Any
    stub: Any
    options: Any = None
    devices: dict[str, str] = field(default_factory=dict)
    """ID → health, as the last ListAndWatch message said."""
    updates: int = 0
    allocated: set[str] = field(default_factory=set)
    watch: asyncio.Task[None] | None = None


class FakeKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: list[Any] = []
        self.plugins: dict[str, Plugin] = {}
        self.changed = asyncio.Condition()
        self._server: Any = None

    async def start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await self._server.start()

    async def stop(self) -> None:
        for p in self.plugins.values():
            if p.watch is not None:
                p.watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await p.watch
            await p.channel.close()
        await self._server.stop(grace=0)

    async def Register(self, request: Any, context: Any) -> Any:
        self.registrations.append(request)
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        old = self.plugins.pop(request.resource_name, None)
        if old is not None and old.watch is not None:
            old.watch.cancel()
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        plugin = Plugin(request.resource_name, request.endpoint, channel, stub)
        self.plugins[request.resource_name] = plugin
        plugin.watch = asyncio.create_task(self._watch(plugin))
        return pb.Empty()

    async def _watch(self, plugin: Plugin) -> None:
        plugin.options = await plugin.stub.GetDevicePluginOptions(pb.Empty())
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in plugin.stub.ListAndWatch(pb.Empty()):
                async with self.changed:
                    plugin.devices = {d.ID: d.health for d in response.devices}
                    plugin.updates += 1
                    self.changed.notify_all()

    async def wait(self, resource: str, updates: int = 1, timeout: float = 10.0) -> Plugin:
        async def ready() -> Plugin:
            async with self.changed:
                await self.changed.wait_for(
                    lambda: resource in self.plugins and self.plugins[resource].updates >= updates
                )
                return self.plugins[resource]

        return await asyncio.wait_for(ready(), timeout)

    async def admit(self, resource: str, count: int) -> tuple[list[str], Any]:
        """Admit one container asking for ``count`` devices: preferred allocation, then Allocate."""
        plugin = self.plugins[resource]
        available = sorted(d for d, h in plugin.devices.items() if h == "Healthy" and d not in plugin.allocated)
        chosen = available[:count]
        if plugin.options.get_preferred_allocation_available:
            request = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=count)
                ]
            )
            preferred = await plugin.stub.GetPreferredAllocation(request)
            chosen = list(preferred.container_responses[0].deviceIDs)
        response = await plugin.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)])
        )
        plugin.allocated.update(chosen)
        return chosen, response.container_responses[0]
