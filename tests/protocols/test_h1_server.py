"""The HTTP/1.1 server's ASGI bridge: streamed answers (chunked, or until the close for HTTP/1.0), HEAD, an app
that fails, the request body as it arrives, and lifespan."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from octacloud.protocols.rest.bridge import AsgiBridge, end_lifespan, run_lifespan
from octacloud.protocols.rest.server import Http1Server


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].rsplit(".", 1)[-1]
            events.append(kind)
            await send({"type": f"{message['type']}.complete"})
            if kind == "shutdown":
                return
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("boom")
    if path == "/echo":
        body = b""
        parts = 0
        while True:
            message = await receive()
            body += message.get("body", b"")
            parts += 1
            if not message.get("more_body"):
                break
        answer = b"%d:%b" % (len(body), body[:10])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-parts", b"%d" % parts)]})
        await send({"type": "http.response.body", "body": answer})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for word in (b"one ", b"two ", b"three"):
        await send({"type": "http.response.body", "body": word, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


events: list[str] = []


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = Http1Server(AsgiBridge(app))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    lifespan = await run_lifespan(app)
    port = await server.start(sock)
    yield port
    await server.stop(1)
    await end_lifespan(lifespan)
    assert events[-2:] == ["startup", "shutdown"]


async def raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    return got


async def test_a_streamed_answer_is_chunked_and_http_1_0_gets_it_until_the_close(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        r = await client.get("/stream")
        assert r.text == "one two three" and r.headers["transfer-encoding"] == "chunked"
        assert "date" in r.headers and "server" not in r.headers
        head = await client.head("/stream")
        assert head.status_code == 200 and head.content == b""
        assert (await client.get("/stream")).text == "one two three"  # the connection stayed in step
    got = await raw(port, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"one two three"


async def test_an_app_that_fails_is_500_and_closed(port: int) -> None:
    got = await raw(port, b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\nGET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 500 ") and b"connection: close" in got.lower()
    assert got.count(b"HTTP/1.1") == 1  # nothing after a failure on the same connection


async def test_the_body_reaches_the_app_as_it_arrives(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    got = b""
    while b"hello worl" not in got:
        got += await asyncio.wait_for(reader.read(4096), 5)
    assert got.startswith(b"HTTP/1.1 200 ") and b"x-parts: 2" in got and got.endswith(b"11:hello worl")
    writer.close()
