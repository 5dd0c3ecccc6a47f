"""The REST server sends each response's head and body in one write (protocols/rest/h1.py)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from octacloud.protocols.rest.h1 import _HeldHeadTransport

from .conftest import ThreadedServer


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def test_head_and_body_go_out_in_one_write() -> None:
    async def go() -> None:
        fake = FakeTransport()
        t = _HeldHeadTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert fake.writes == []
        t.write(b"{}")
        assert fake.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing held
        assert len(fake.writes) == 1
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the transport's

    asyncio.run(go())


def test_a_head_alone_goes_out_on_the_next_loop_turn_or_on_close() -> None:
    async def go() -> None:
        fake = FakeTransport()
        t = _HeldHeadTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await asyncio.sleep(0)
        assert fake.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        t.close()
        assert fake.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n" and fake.closed
        t.write(b"plain bytes")  # not a head: straight through
        assert fake.writes[-1] == b"plain bytes"

    asyncio.run(go())


def test_keep_alive_requests_each_get_a_whole_response(server: ThreadedServer) -> None:
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        for _ in range(3):
            two = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
            s.sendall(two)  # pipelined
            got = b""
            while got.count(b"HTTP/1.1 200") < 2:
                chunk = s.recv(65536)
                assert chunk
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"server: uvicorn" not in got
