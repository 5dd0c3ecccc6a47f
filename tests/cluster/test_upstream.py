"""The gateway's upstream client: keep-alive connections are reused, `Connection: close` is honoured, a pooled
connection the replica dropped is retried on a fresh one, and an unreachable replica is an UpstreamError."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from octacloud.cluster.gateway.upstream import UpstreamError, UpstreamPool


class _Server:
    """A uvicorn app that answers with the body reversed, optionally closing each connection."""

    def __init__(self) -> None:
        self.close_after = False

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = (await receive()).get("body", b"")
        headers = [(b"content-type", b"application/octet-stream")]
        if self.close_after:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[::-1]})


@pytest.fixture
async def server() -> AsyncIterator[tuple[_Server, int, uvicorn.Server]]:
    app = _Server()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, http="httptools", log_level="warning", access_log=False))
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield app, port, srv
    srv.should_exit = True
    await task
    await asyncio.sleep(0.05)  # let connections the pool closed itself finish closing on this loop


def _count_connects(pool: UpstreamPool) -> list[int]:
    count = [0]
    original = pool._connect

    async def counting(host: str, port: int):  # type: ignore[no-untyped-def]
        count[0] += 1
        return await original(host, port)

    pool._connect = counting  # type: ignore[method-assign]
    return count


async def test_keep_alive_connections_are_reused(server: tuple[_Server, int, uvicorn.Server]) -> None:
    _, port, _ = server
    pool = UpstreamPool()
    connects = _count_connects(pool)
    for i in range(20):
        response = await pool.request("127.0.0.1", port, b"POST", b"/v2/x", [], f"abc{i}".encode())
        assert response.status == 200
        assert response.body == f"abc{i}".encode()[::-1]
    assert connects[0] == 1  # one connection carried all twenty exchanges
    # concurrent requests each need a connection, and give them back for the next round
    await asyncio.gather(*(pool.request("127.0.0.1", port, b"POST", b"/", [], b"x") for _ in range(8)))
    before = connects[0]
    await asyncio.gather(*(pool.request("127.0.0.1", port, b"POST", b"/", [], b"x") for _ in range(8)))
    assert connects[0] == before
    await pool.close()


async def test_connection_close_is_honoured(server: tuple[_Server, int, uvicorn.Server]) -> None:
    app, port, _ = server
    app.close_after = True
    pool = UpstreamPool()
    connects = _count_connects(pool)
    for _ in range(3):
        assert (await pool.request("127.0.0.1", port, b"POST", b"/", [], b"x")).status == 200
    assert connects[0] == 3
    await pool.close()


async def test_a_dropped_idle_connection_is_retried_on_a_fresh_one(
    server: tuple[_Server, int, uvicorn.Server],
) -> None:
    _, port, _ = server
    pool = UpstreamPool()
    connects = _count_connects(pool)
    assert (await pool.request("127.0.0.1", port, b"POST", b"/", [], b"one")).status == 200
    # the replica side closes the idle connection (as a restarted replica or its keep-alive timeout would)
    [conn] = pool._idle[("127.0.0.1", port)]
    conn.writer.transport.get_extra_info("socket").shutdown(socket.SHUT_RD)
    assert (await pool.request("127.0.0.1", port, b"POST", b"/", [], b"two")).body == b"owt"
    assert connects[0] == 2
    await pool.close()


async def test_an_unreachable_replica_is_an_upstream_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    with pytest.raises(UpstreamError, match=f"cannot connect to replica at 127.0.0.1:{port}"):
        await UpstreamPool().request("127.0.0.1", port, b"GET", b"/", [], b"")


async def test_connections_to_a_replica_that_went_away_are_swept(server: tuple[_Server, int, uvicorn.Server]) -> None:
    _, port, srv = server
    pool = UpstreamPool()
    await asyncio.gather(*(pool.request("127.0.0.1", port, b"POST", b"/", [], b"x") for _ in range(3)))
    assert pool.idle_connections() == 3
    assert pool.sweep() == 0  # all still open
    srv.should_exit = True  # the replica stops: it closes its keep-alive connections
    for _ in range(200):
        await asyncio.sleep(0.01)
        if all(c.reader.at_eof() for conns in pool._idle.values() for c in conns):
            break
    assert pool.sweep() == 3
    assert pool.idle_connections() == 0
    await pool.close()
