"""The gateway's front servers (``gateway/fronts.py``): one port shared by several servers with
SO_REUSEPORT, and a clear failure without it."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from octacloud.gateway.fronts import GrpcFront, RestFront, bind_socket, gateway_fronts
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import RouteTable
from octacloud.protocols.asgi import Receive, Scope, Send, json_reply

pytestmark = pytest.mark.slow


def answering(name: str):  # type: ignore[no-untyped-def]
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await json_reply(send, 200, {"server": name})

    return app


def test_a_port_is_shared_only_with_reuse_port() -> None:
    first = bind_socket("127.0.0.1", 0, reuse_port=True, reuse_addr=False)  # as the main process reserves it
    port = first.getsockname()[1]
    try:
        with bind_socket("127.0.0.1", port, reuse_port=True):
            pass
        with pytest.raises(OSError, match="in use"), bind_socket("127.0.0.1", port, reuse_port=False):
            pass
    finally:
        first.close()


async def test_two_rest_fronts_on_one_port_both_serve() -> None:
    limits = GatewayLimits()
    reserved = bind_socket("127.0.0.1", 0, reuse_port=True, reuse_addr=False)  # reserves the port, takes no connections
    port = reserved.getsockname()[1]
    fronts = [RestFront(answering("a"), limits), RestFront(answering("b"), limits)]
    try:
        assert [await f.start("127.0.0.1", port, reuse_port=True) for f in fronts] == [port, port]
        seen: set[str] = set()
        async with httpx.AsyncClient() as client:
            for _ in range(64):  # fresh connections: the kernel spreads them over both listeners
                r = await client.get(f"http://127.0.0.1:{port}/", headers={"connection": "close"})
                seen.add(r.json()["server"])
                if seen == {"a", "b"}:
                    break
        assert seen == {"a", "b"}
        await fronts[0].stop(0.5)  # one stops: the other alone serves the port
        async with httpx.AsyncClient() as client:
            answers = {(await client.get(f"http://127.0.0.1:{port}/")).json()["server"] for _ in range(8)}
        assert answers == {"b"}
    finally:
        for f in fronts:
            await f.stop(0.5)
        reserved.close()


async def test_a_taken_port_fails_the_start_and_leaves_nothing_listening() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    routes = RouteTable()
    limits = GatewayLimits()
    try:
        fronts = gateway_fronts(RestGateway(routes), GrpcGateway(routes), limits, None)
        with pytest.raises((OSError, RuntimeError)):
            await fronts.start("127.0.0.1", port, 0)  # REST on a taken port: gRPC, already up, is stopped
        grpc_front = GrpcFront(GrpcGateway(routes), limits)
        with pytest.raises((OSError, RuntimeError)):
            await grpc_front.start("127.0.0.1", port, reuse_port=False)
        await grpc_front.stop(0)
    finally:
        taken.close()
    await asyncio.sleep(0)
