"""A gateway in front of fake replicas, all on this test's event loop: fast, no models, every byte visible."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from octacloud.gateway.fronts import RestFront
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import Endpoint, OutlierPolicy, Owner, RouteTable
from octacloud.protocols.internal import RequireSecret

SECRET = "s" * 43


@dataclass
class FakeReplica:
    """An OIP-ish replica: POST echoes the body reversed, GET answers JSON; records what it received."""

    delay_s: float = 0.0
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # served with lifespan="off"
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append({"method": scope["method"], "path": scope["path"], "headers": scope["headers"], "body": body})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        answer = body[::-1] if scope["method"] == "POST" else b'{"ready": true}'
        headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


async def serve(app: Any, http: Any = "httptools", port: int = 0, **options: Any) -> tuple[uvicorn.Server, int]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, http=http, log_level="warning", access_log=False, lifespan="off", **options)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    server.task = task  # type: ignore[attr-defined]
    return server, port


async def stop(server: uvicorn.Server) -> None:
    server.should_exit = True
    await server.task  # type: ignore[attr-defined]


@dataclass
class Gateway:
    routes: RouteTable
    app: RestGateway
    server: RestFront
    port: int
    replicas: list[tuple[FakeReplica, uvicorn.Server, int]]

    async def close(self) -> None:
        await self.server.stop(1)
        for _, server, _ in self.replicas:
            await stop(server)
        await self.app.pool.close()


async def gateway(
    limits: GatewayLimits | None = None,
    replicas: int = 1,
    delay_s: float = 0.0,
    ready: Callable[[], bool] = lambda: True,
    outlier: OutlierPolicy | None = None,
    request_timeout: float = 10.0,
    identify: bool = False,
) -> Gateway:
    """``identify``: each fake sits behind the replicas' own guard (``RequireSecret`` with its id, ``r0``, ``r1``…):
    it answers 401 without the secret and 421 to a request meant for another replica."""
    limits = limits or GatewayLimits()
    routes = RouteTable(outlier=outlier or OutlierPolicy())
    started = []
    for i in range(replicas):
        fake = FakeReplica(delay_s)
        server, port = await serve(RequireSecret(fake, SECRET.encode(), f"r{i}") if identify else fake)
        started.append((fake, server, port))
    routes.update("m", [Endpoint(f"r{i}", "127.0.0.1", port, 0) for i, (_, _, port) in enumerate(started)])
    routes.owners["m"] = Owner("t")
    app = RestGateway(routes, ready=ready, limits=limits, internal_secret=SECRET, request_timeout=request_timeout)
    front = RestFront(app, limits)  # the gateway's own front, as `octacloud up` serves it
    port = await front.start("127.0.0.1", 0, reuse_port=False)
    return Gateway(routes, app, front, port, started)


async def exchange(port: int, data: bytes, read_until: Callable[[bytes], bool], timeout: float = 5.0) -> bytes:
    """Send raw bytes on a new connection and read until ``read_until(received)`` (or the connection ends)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read(reader, read_until, timeout)
    finally:
        writer.close()


async def read(reader: asyncio.StreamReader, until: Callable[[bytes], bool], timeout: float = 5.0) -> bytes:
    got = b""

    async def loop() -> None:
        nonlocal got
        while not until(got):
            chunk = await reader.read(65536)
            if not chunk:
                return
            got += chunk

    await asyncio.wait_for(loop(), timeout)
    return got


def parse(data: bytes) -> tuple[list[tuple[int, dict[bytes, bytes], bytes]], bool]:
    """Raw HTTP/1.1 answers (framed by Content-Length) as (status, headers, body); and whether the last one is
    complete. A ``100 Continue`` counts as an answer of its own (it has no body)."""
    out: list[tuple[int, dict[bytes, bytes], bytes]] = []
    while data:
        if b"\r\n\r\n" not in data:
            return out, False
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        if len(rest) < length:
            return out, False
        out.append((status, headers, rest[:length]))
        data = rest[length:]
    return out, True


def answers(data: bytes) -> list[tuple[int, bytes]]:
    return [(status, body) for status, _, body in parse(data)[0]]


def complete(n: int) -> Callable[[bytes], bool]:
    """A ``read_until`` that waits for ``n`` whole answers."""

    def done(data: bytes) -> bool:
        parts, whole = parse(data)
        return whole and len(parts) >= n

    return done
