"""A small keep-alive HTTP/1.1 client for gateway → replica traffic.

The gateway forwards bodies as they are (JSON or Triton's binary tensors), so it needs no general HTTP
client, only a fast one: pooled connections, ``httptools`` to parse responses, no per-request object churn.
A transport failure (refused, reset, closed before a full response) raises :class:`UpstreamError`, which the
gateway answers by retrying on another replica: OIP inference is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httptools


class UpstreamError(Exception):
    """The replica could not be reached or dropped the connection before answering."""


@dataclass(slots=True)
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(slots=True)
class _Parse:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    done: bool = False
    keep_alive: bool = False
    parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        # llhttp answers should_keep_alive() only inside a callback: once the message is complete and
        # feed_data() has returned, the parser has reset and says False for every response.
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        self.done = True


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection", b"host"}


class UpstreamPool:
    """Pooled keep-alive connections to many replicas."""

    def __init__(self, max_idle_per_host: int = 64, connect_timeout: float = 2.0, sweep_s: float = 5.0) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self.max_idle = max_idle_per_host
        self.connect_timeout = connect_timeout
        self.sweep_s = sweep_s
        """How often idle connections are checked: those the replica closed (its keep-alive timeout, or the
        replica is gone) are dropped, so a pool that outlives many replicas does not keep their sockets."""
        self._next_sweep = 0.0

    async def request(
        self,
        host: str,
        port: int,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout: float | None = None,
    ) -> Response:
        key = (host, port)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_s
            self.sweep()
        conn = self._take(key)
        fresh = conn is None
        if conn is None:
            conn = await self._connect(host, port)
        try:
            return await asyncio.wait_for(self._exchange(key, conn, method, target, headers, body), timeout)
        except UpstreamError:
            if fresh:
                raise
            # A pooled connection the replica closed while idle: try once on a fresh one.
            conn = await self._connect(host, port)
            return await asyncio.wait_for(self._exchange(key, conn, method, target, headers, body), timeout)
        except TimeoutError:
            conn.close()
            raise

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to replica at {host}:{port}: {exc}") from None
        return _Connection(reader, writer)

    async def _exchange(
        self,
        key: tuple[str, int],
        conn: _Connection,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> Response:
        head = [method, b" ", target, b" HTTP/1.1\r\nHost: ", key[0].encode(), b"\r\n"]
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != b"content-length":
                head += [name, b": ", value, b"\r\n"]
        head += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        parse = _Parse()
        parser = httptools.HttpResponseParser(parse)
        parse.parser = parser
        try:
            conn.writer.write(b"".join(head))  # one send: head and body together
            while not parse.done:
                data = await conn.reader.read(262144)
                if not data:
                    raise UpstreamError(f"replica at {key[0]}:{key[1]} closed the connection before answering")
                parser.feed_data(data)
        except (OSError, httptools.HttpParserError) as exc:
            conn.close()
            raise UpstreamError(f"replica at {key[0]}:{key[1]} failed: {exc}") from None
        except BaseException:
            conn.close()
            raise
        if parse.keep_alive:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
            else:
                conn.close()
        else:
            conn.close()
        body_out = parse.chunks[0] if len(parse.chunks) == 1 else b"".join(parse.chunks)
        return Response(parser.get_status_code(), parse.headers, body_out)

    def sweep(self) -> int:
        """Close idle connections the other side has closed; returns how many were dropped."""
        dropped = 0
        for key in list(self._idle):
            alive = []
            for conn in self._idle[key]:
                if conn.writer.is_closing() or conn.reader.at_eof():
                    conn.close()
                    dropped += 1
                else:
                    alive.append(conn)
            if alive:
                self._idle[key] = alive
            else:
                del self._idle[key]
        return dropped

    def idle_connections(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    def forget(self, host: str, port: int) -> None:
        """Close idle connections to a replica that went away."""
        for conn in self._idle.pop((host, port), []):
            conn.close()

    async def close(self) -> None:
        conns = [conn for idle in self._idle.values() for conn in idle]
        self._idle.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()
