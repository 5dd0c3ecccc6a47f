"""The gateway's upstream client: keep-alive connections are reused, `Connection: close` is honoured, a pooled
connection the replica dropped is retried on a fresh one, and an unreachable replica is an UpstreamError."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from octacloud.gateway.upstream import ReplicaGone, UpstreamError, UpstreamPool


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

    async def counting(host: str, port: int, server_name: str | None = None):  # type: ignore[no-untyped-def]
        count[0] += 1
        return await original(host, port, server_name)

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
    conn.transport.get_extra_info("socket").shutdown(socket.SHUT_RD)
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
        if not any(c.alive for conns in pool._idle.values() for c in conns):
            break
    assert pool.sweep() == 3
    assert pool.idle_connections() == 0
    await pool.close()


class _Scripted:
    """A raw TCP server that answers each request with the next scripted bytes (and records what it read)."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                writer.write(self.answers.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), b"".join(extra), body)


async def test_interim_answers_are_skipped_and_expect_is_never_forwarded() -> None:
    """A replica's `100 Continue` is not the answer: the final one is, and the connection stays in step."""
    scripted = _Scripted([b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"first"), _ok(b"second")])
    async with scripted as port:
        pool = UpstreamPool()
        headers = [(b"Expect", b"100-continue"), (b"Content-Type", b"application/json")]
        first = await pool.request("127.0.0.1", port, b"POST", b"/a", headers, b"x" * 10)
        second = await pool.request("127.0.0.1", port, b"POST", b"/b", [], b"y")
        await pool.close()
    assert (first.status, first.body) == (200, b"first")
    assert (second.status, second.body) == (200, b"second")
    assert scripted.connections == 1
    assert b"expect" not in scripted.requests[0].lower()
    assert b"content-type: application/json" in scripted.requests[0].lower()


async def test_early_hints_then_answer_in_separate_packets() -> None:
    scripted = _Scripted([b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + _ok(b"done", b"X-A: 1\r\n")])
    async with scripted as port:
        pool = UpstreamPool()
        response = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
        await pool.close()
    assert (response.status, response.body) == (200, b"done")
    assert (b"X-A", b"1") in response.headers and all(k != b"Link" for k, _ in response.headers)


async def test_head_answers_have_no_body_and_do_not_hang() -> None:
    scripted = _Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", _ok(b"after")])
    async with scripted as port:
        pool = UpstreamPool()
        head = await pool.request("127.0.0.1", port, b"HEAD", b"/", [], b"", timeout=5)
        after = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)
        await pool.close()
    assert (head.status, head.body) == (200, b"")
    assert (b"Content-Length", b"1234") in head.headers
    assert after.body == b"after"
    assert scripted.connections == 1  # the HEAD answer ended at its head: the connection was reused


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_204_and_304_have_no_body(status: bytes) -> None:
    scripted = _Scripted([b"HTTP/1.1 " + status + b"\r\n\r\n", _ok(b"next")])
    async with scripted as port:
        pool = UpstreamPool()
        first = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)
        second = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)
        await pool.close()
    assert first.body == b"" and second.body == b"next"


async def test_a_connection_with_bytes_past_the_answer_is_never_pooled() -> None:
    """Extra bytes after an answer (a second answer nobody asked for) would be the next request's answer."""
    scripted = _Scripted([_ok(b"mine") + _ok(b"stale"), _ok(b"fresh")])
    async with scripted as port:
        pool = UpstreamPool()
        connects = _count_connects(pool)
        first = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
        assert pool.idle_connections() == 0
        second = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
        await pool.close()
    assert (first.body, second.body) == (b"mine", b"fresh")
    assert connects[0] == 2


async def test_bytes_arriving_on_an_idle_connection_close_it() -> None:
    pool = UpstreamPool()
    got_request = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_ok(b"one"))
        got_request.set()
        await asyncio.sleep(0.05)
        writer.write(_ok(b"late"))  # unsolicited: arrives while the connection is idle in the pool
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert (await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")).body == b"one"
    await asyncio.sleep(0.2)
    assert pool._take(("127.0.0.1", port)) is None  # closed, not handed out with "late" waiting in it
    await pool.close()
    for w in writers:
        w.close()
    server.close()
    await server.wait_closed()


async def test_an_answer_delimited_by_close_is_read_to_its_end() -> None:
    scripted = _Scripted([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof"])
    async with scripted as port:
        pool = UpstreamPool()
        response = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)
        assert pool.idle_connections() == 0
        await pool.close()
    assert response.body == b"until-eof"


async def test_a_timed_out_exchange_closes_its_connection() -> None:
    scripted = _Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", b""])  # then it stalls
    async with scripted as port:
        pool = UpstreamPool()
        with pytest.raises(TimeoutError):
            await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=0.2)
        assert pool.idle_connections() == 0
        await pool.close()


def test_the_pool_works_on_uvloop() -> None:
    """``octacloud up`` runs on uvloop, whose transports are not asyncio.Transport instances."""
    import uvloop

    async def run() -> tuple[bytes, bytes]:
        scripted = _Scripted([b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"uv"), _ok(b"loop")])
        async with scripted as port:
            pool = UpstreamPool()
            first = await pool.request("127.0.0.1", port, b"POST", b"/", [], b"x", timeout=5)
            second = await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)
            await pool.close()
        return first.body, second.body

    assert uvloop.run(run()) == (b"uv", b"loop")


async def test_an_exchange_with_a_replica_found_dead_ends_at_once_and_is_not_retried_there() -> None:
    """A replica that took the request and will never answer (its process died, the connection lingers): once the
    controller finds it dead, the exchange ends with ReplicaGone within the loop's turn, not at the timeout, and
    the pool does not send it to the same replica again on a fresh connection."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_ok(b"first"))  # the first request is answered: the connection goes back to the pool
        await reader.readuntil(b"\r\n\r\n")  # the second is read and never answered
        await asyncio.sleep(60)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool()
    try:
        assert (await pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=5)).body == b"first"
        assert pool.idle_connections() == 1
        exchange = asyncio.ensure_future(pool.request("127.0.0.1", port, b"GET", b"/", [], b"", timeout=30))
        await asyncio.sleep(0.1)
        assert not exchange.done()
        assert pool.abandon("127.0.0.1", 9, "unrelated") == 0  # another replica's address: nothing ends
        started = asyncio.get_running_loop().time()
        assert pool.abandon("127.0.0.1", port, "the controller found it stopped") == 1
        with pytest.raises(ReplicaGone, match="the controller found it stopped"):
            await exchange
        assert asyncio.get_running_loop().time() - started < 1.0
        assert len(accepted) == 1 and pool.idle_connections() == 0
        assert pool.abandon("127.0.0.1", port, "again") == 0  # nothing left in flight
    finally:
        await pool.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
