"""Serving a :class:`~octacloud.k8s.deviceplugin.DevicePlugin` to kubelet: its unix socket in kubelet's device
plugin directory, its registration with kubelet's ``Registration`` service, and both done again after kubelet
restarts (it removes every socket in the directory)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from octacloud.core.model import Health
from octacloud.k8s.api import ApiError
from octacloud.k8s.deviceplugin import API_VERSION, DEVICE_PLUGIN_DIR, KUBELET_SOCKET, DevicePlugin
from octacloud.k8s.v1beta1 import api_pb2 as pb
from octacloud.k8s.v1beta1 import api_pb2_grpc as pb_grpc

log = logging.getLogger("octacloud.k8s.deviceplugin")


def socket_name(resource: str) -> str:
    return f"octacloud-{resource.split('/')[-1]}.sock"


@dataclass
class PluginServer:
    """Serves a :class:`DevicePlugin` on its socket and keeps it registered with kubelet.

    kubelet removes every socket in its device plugin directory when it restarts; the server notices that its
    socket is gone, serves again and registers again.
    """

    plugin: DevicePlugin
    directory: Path = DEVICE_PLUGIN_DIR
    kubelet_socket: str = KUBELET_SOCKET
    poll_s: float = 1.0
    on_health: Callable[[list[Health]], Awaitable[None]] | None = None
    """Called when card health changes (e.g. to publish it on the node)."""
    registrations: int = 0
    _server: Any = None

    @property
    def socket(self) -> Path:
        return self.directory / socket_name(self.plugin.resource)

    async def start(self) -> None:
        """Serve on the socket and register with kubelet (raises when kubelet refuses or is not there)."""
        await self.serve()
        await self.register()

    async def serve(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.plugin, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def register(self) -> None:
        """Call kubelet's ``Registration.Register`` for this plugin's resource and socket."""
        options = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=self.socket.name, resource_name=self.plugin.resource, options=options
        )
        async with grpc.aio.insecure_channel(f"unix://{self.directory / self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            await stub.Register(request, timeout=10)
        self.registrations += 1
        log.info("registered %s with kubelet (socket %s)", self.plugin.resource, self.socket.name)

    async def stop(self) -> None:
        await self.plugin.stop()
        if self._server is not None:
            await self._server.stop(grace=1)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``: health is re-read every ``poll_s``; registration is retried until kubelet accepts
        it (kubelet may start after the plugin), and done again after a kubelet restart removed the socket."""
        registered = False
        try:
            while not stop.is_set():
                if self._server is None or not self.socket.exists():
                    if self._server is not None:
                        log.info("socket %s is gone (kubelet restarted): serving and registering again", self.socket)
                        await self._server.stop(grace=0)
                    await self.serve()
                    registered = False
                if not registered:
                    try:
                        await self.register()
                        registered = True
                    except grpc.aio.AioRpcError as exc:
                        log.warning("kubelet did not take the registration (%s); retrying", exc.details())
                if await self.plugin.refresh_health() and self.on_health is not None:
                    try:
                        await self.on_health(self.plugin.health)
                    except ApiError as exc:
                        log.warning("cannot publish card health (%s)", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
        finally:
            await self.stop()
