"""A small keep-alive HTTP/1.1 client for gateway → replica traffic.

The gateway forwards bodies as they are (JSON or Triton's binary tensors), so it needs no general HTTP
client, only a fast and exact one: pooled connections, each an asyncio protocol that feeds ``httptools``
directly, no per-request object churn.

A proxy that pools connections must know exactly where each answer ends, or the next request on the
connection reads the previous one's answer (another tenant's). So:

- interim ``1xx`` answers (``100 Continue``, ``103 Early Hints``) are skipped: the answer is the final one;
- answers to ``HEAD`` and ``1xx``/``204``/``304`` answers have no body, whatever their ``Content-Length`` says;
- a connection goes back to the pool only when its answer was read to the end, the replica said keep-alive,
  and not one byte more arrived; bytes that arrive on an idle connection close it.

A transport failure (refused, reset, closed before a full answer) raises :class:`UpstreamError`, which the
gateway answers by retrying on another replica: OIP inference is idempotent. A replica the controller found
dead is *abandoned* (:meth:`UpstreamPool.abandon`): the exchanges in flight to it end at once with
:class:`ReplicaGone` and are retried elsewhere, instead of waiting out the request timeout on a connection the
kernel may never close (one accepted by a listener that died with the replica, but not yet by the replica).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import cast

import httptools

from octacloud.idlespin import poke


class UpstreamError(Exception):
    """The replica could not be reached or dropped the connection before answering."""


class ReplicaGone(UpstreamError):
    """The replica was found dead while the exchange waited for its answer (never retried on the same one)."""


@dataclass(slots=True)
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"proxy-connection",
    b"proxy-authorization",
    b"host",
    b"expect",
    b"content-length",
}
"""Request headers the gateway never forwards: they describe the client's connection, not the request
(``Expect: 100-continue`` is answered by the gateway itself; the body is sent whole with its own length)."""


class _Connection(asyncio.Protocol):
    """One connection to a replica; parses the answer to the request in flight as its bytes arrive."""

    __slots__ = (
        "_chunks",
        "_done",
        "_extra",
        "_head_only",
        "_headers",
        "_keep_alive",
        "_parser",
        "_status",
        "_waiter",
        "closed",
        "label",
        "transport",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[Response] | None = None
        self._head_only = False
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._keep_alive = False
        self._done = False
        self._extra = False

    # ---- asyncio protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        poke()
        if self._parser is None or self._done:
            # Bytes nobody asked for (on an idle connection, or after the answer): the connection is out of step.
            self._extra = True
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self._done:
                self._fail(UpstreamError(f"replica {self.label} sent a malformed answer: {exc}"))
            self._extra = True
            self.close()

    def eof_received(self) -> bool | None:
        if self._status >= 200 and not self._done and self._until_eof():
            self._keep_alive = False  # an answer with neither a length nor chunks ends with the connection
            self._finish()
        return None

    def _until_eof(self) -> bool:
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._done:
            self._fail(UpstreamError(f"replica {self.label} closed the connection before answering"))

    # ---- httptools callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._done:  # a second answer in the same bytes: the connection is out of step
            self._extra = True
        self._headers = []
        self._chunks = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._status = self._parser.get_status_code()  # 0 until a head is complete
        if self._head_only and self._status >= 200:
            # A HEAD answer ends with its head; llhttp would wait for the Content-Length it announces.
            self._keep_alive = self._parser.should_keep_alive()
            self._finish()

    def on_body(self, body: bytes) -> None:
        if self._done:  # bytes after a HEAD answer's head: not ours to read
            self._extra = True
        else:
            self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._done:
            return
        assert self._parser is not None
        if 100 <= self._status < 200:
            if self._status == 101:  # the gateway never asks to switch protocols
                self._fail(UpstreamError(f"replica {self.label} switched protocols unasked"))
                self._extra = True
            return  # an interim answer: the final one follows on this connection
        # llhttp answers should_keep_alive() only inside a callback: once feed_data() returns it has reset.
        self._keep_alive = self._parser.should_keep_alive()
        self._finish()

    # ---- the exchange -----------------------------------------------------------------------------------

    def _finish(self) -> None:
        self._done = True
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(Response(self._status, self._headers, body))

    def _fail(self, exc: Exception) -> None:
        self._done = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    async def exchange(self, request: bytes, head_only: bool, timeout: float | None = None) -> Response:
        """Send ``request`` (head and body) and return the final answer to it; ``TimeoutError`` after ``timeout``
        seconds (a plain timer on the loop: no task, no context manager)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response] = loop.create_future()
        self._waiter = waiter
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self._status = 0
        self._done = self._extra = self._keep_alive = False
        timer = loop.call_later(timeout, self._timed_out) if timeout is not None else None
        try:
            self.transport.write(request)  # one send: head and body together
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def abandon(self, why: str) -> None:
        """The replica is gone: the exchange in flight (if any) ends with :class:`ReplicaGone`, and the connection
        closes."""
        if not self._done:
            self._fail(ReplicaGone(f"replica {self.label}: {why}"))
        self.close()

    def _timed_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError())

    @property
    def reusable(self) -> bool:
        """True when the last answer was read to its end, the replica keeps the connection, and nothing more came."""
        return self._done and self._keep_alive and not self._extra and not self.closed and self._parser is not None

    def idle(self) -> None:
        """Between exchanges: any byte that arrives now closes the connection."""
        self._parser = None

    @property
    def alive(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def wait_closed(self) -> None:
        for _ in range(100):
            if self.closed:
                return
            await asyncio.sleep(0.001)


def encode_request(
    host: str, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, filtered: bool = False
) -> bytes:
    """The request as it goes on the wire: the caller's end-to-end headers, a Host and the body's length.
    ``filtered``: the caller already left out every ``HOP_BY_HOP`` header."""
    head = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host.encode(), b"\r\n"]
    for name, value in headers:
        if filtered or name.lower() not in HOP_BY_HOP:
            head += [name, b": ", value, b"\r\n"]
    if body or method not in (b"GET", b"HEAD"):
        head += [b"Content-Length: ", str(len(body)).encode(), b"\r\n"]
    head += [b"\r\n", body]
    return b"".join(head)


class UpstreamPool:
    """Pooled keep-alive connections to many replicas."""

    def __init__(
        self,
        max_idle_per_host: int = 64,
        connect_timeout: float = 2.0,
        sweep_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tls = tls
        """Internal TLS: connections are TLS, the replica's certificate checked against this context's CA and
        the address dialled (or the ``server_name`` a request names)."""
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: dict[tuple[str, int], set[_Connection]] = {}
        """Connections with an exchange in flight, by replica address (for :meth:`abandon`)."""
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
        server_name: str | None = None,
        filtered: bool = False,
    ) -> Response:
        """``filtered``: ``headers`` hold no ``HOP_BY_HOP`` header (lowercase names, checked by the caller)."""
        key = (host, port)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_s
            self.sweep()
        wire = encode_request(host, method, target, headers, body, filtered)
        head_only = method == b"HEAD"
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(key, conn, wire, head_only, timeout)
            except ReplicaGone:
                raise
            except UpstreamError:
                pass  # a pooled connection the replica closed while idle: try once on a fresh one
        conn = await self._connect(host, port, server_name)
        return await self._exchange(key, conn, wire, head_only, timeout)

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.alive:
                return conn
            conn.close()
        return None

    async def _connect(self, host: str, port: int, server_name: str | None = None) -> _Connection:
        loop = asyncio.get_running_loop()
        label = f"{host}:{port}"
        name = (server_name or host) if self.tls is not None else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(label), host, port, ssl=self.tls, server_hostname=name),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to replica at {label}: {exc or type(exc).__name__}") from None
        return conn

    async def _exchange(
        self, key: tuple[str, int], conn: _Connection, wire: bytes, head_only: bool, timeout: float | None
    ) -> Response:
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = set()
        busy.add(conn)
        try:
            response = await conn.exchange(wire, head_only, timeout)
        except BaseException:  # failed, timed out or cancelled: the answer's end is unknown
            conn.close()
            raise
        finally:
            busy.discard(conn)
            if not busy and self._busy.get(key) is busy:
                del self._busy[key]
        if conn.reusable:
            conn.idle()
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return response
        conn.close()
        return response

    def sweep(self) -> int:
        """Close idle connections the other side has closed; returns how many were dropped."""
        dropped = 0
        for key in list(self._idle):
            alive = []
            for conn in self._idle[key]:
                if conn.alive:
                    alive.append(conn)
                else:
                    conn.close()
                    dropped += 1
            if alive:
                self._idle[key] = alive
            else:
                del self._idle[key]
        return dropped

    def idle_connections(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    def forget(self, host: str, port: int) -> None:
        """Close idle connections to a replica that went away (the route table calls this when it drops one)."""
        for conn in self._idle.pop((host, port), []):
            conn.close()

    def abandon(self, host: str, port: int, why: str) -> int:
        """A replica found dead: close its idle connections, and end each exchange in flight to it with
        :class:`ReplicaGone` (the caller retries it on another replica); returns how many were in flight."""
        self.forget(host, port)
        busy = list(self._busy.get((host, port), ()))
        for conn in busy:
            conn.abandon(why)
        return len(busy)

    async def close(self) -> None:
        conns = [conn for idle in self._idle.values() for conn in idle]
        self._idle.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            await conn.wait_closed()
