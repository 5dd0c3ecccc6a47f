"""A small gRPC client over HTTP/2 on the event loop: unary calls whose messages travel as bytes.

The cloud's gateway forwards gRPC calls to replicas without decoding them. ``grpc.aio`` as the client costs
the gateway more than the call itself (its poller thread wakes the loop several times per call, measured);
here a call is one HEADERS and one DATA frame in one write, sent at once, and the answer is read from the
frames as they arrive. Calls are not held back to share a write with the rest of the loop turn's: a gateway
that forwards a burst of calls in one write hands the replica the whole burst at once, the replica answers it
as one batch, and the callers' next calls come back as one burst again, so that the replica computes while
the gateway and the callers wait and the other way round. Sent as they are forwarded, the calls reach the
replica as spread out as they left their callers, and its batches form as they do for direct callers
(``bench/cloud.py``, docs/gateway.md). HPACK decoding comes from ``hpack``;
requests are encoded as literals without indexing, so no encoder state is kept.

:class:`Channel` holds the HTTP/2 connections to one replica: a call goes on the first connection with a free
stream (the replica's ``SETTINGS_MAX_CONCURRENT_STREAMS``), or on a new one. :class:`Unreachable` means the
replica never saw the call (refused, reset, or a GOAWAY that did not include the stream): retrying it
elsewhere is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from octacloud.protocols.grpc.h2_client_connection import Answer, ClientConnection, Unreachable
from octacloud.protocols.grpc.h2_frames import int7

_GRPC_FIELDS = b"\x0f\x10\x10application/grpc\x00\x02te\x08trailers"
"""content-type: application/grpc (literal, static name 31), te: trailers (literal): after the pseudo-headers
(RFC 9113 8.3: a pseudo-header after a regular field makes the request malformed)."""


def _expire(future: asyncio.Future[Answer]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class Channel:
    """HTTP/2 connections to one gRPC server (``host:port``), opened as calls need them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout: float = 2.0,
    ) -> None:
        self.host, self.port = host, port
        self.label = f"{host}:{port}"
        self.ssl_context = ssl_context
        """TLS to the server (it must offer ALPN ``h2``); None: plain text."""
        self.server_hostname = server_hostname
        self.connect_timeout = connect_timeout
        scheme = b"\x87" if ssl_context is not None else b"\x86"  # :scheme https / http (static 7 / 6)
        authority = f"{host}:{port}".encode()
        # :method POST (static 3), :scheme, :authority (static name 1)
        self._prefix = b"\x83" + scheme + b"\x01" + int7(len(authority)) + authority
        self._paths: dict[str, bytes] = {}
        self._connections: list[ClientConnection] = []
        self._connecting: asyncio.Future[ClientConnection] | None = None
        self.closed = False

    async def call(self, path: str, metadata: bytes, message: bytes, timeout: float | None = None) -> Answer:
        """Call ``path`` with ``metadata`` (an HPACK block of literals, see ``h2.metadata_block``) and the
        request ``message``; returns the answer, raises :class:`Unreachable` or ``TimeoutError``."""
        head = self._paths.get(path)
        if head is None:
            raw = path.encode()
            head = self._paths[path] = self._prefix + b"\x04" + int7(len(raw)) + raw + _GRPC_FIELDS  # :path (4)
        conn = self._usable() or await self._connect()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        c = conn.start(head + metadata, message, future)
        # The deadline is a plain loop timer that fails the future: no timeout context, no task lookup per call.
        timer = None if timeout is None else loop.call_later(timeout, _expire, future)
        try:
            return await future
        except (TimeoutError, asyncio.CancelledError):
            conn.cancel(c)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _usable(self) -> ClientConnection | None:
        for conn in self._connections:
            if conn.usable:
                return conn
        return None

    async def _connect(self) -> ClientConnection:
        if self.closed:
            raise Unreachable(f"the channel to {self.label} is closed")
        if self._connecting is not None:  # calls that arrive together share one new connection
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: ClientConnection(self.label, self._dropped),
                        self.host,
                        self.port,
                        ssl=self.ssl_context,
                        server_hostname=self.server_hostname if self.ssl_context is not None else None,
                    ),
                    self.connect_timeout,
                )
            except (OSError, TimeoutError, ssl.SSLError) as e:
                raise Unreachable(f"cannot connect to {self.label}: {e or type(e).__name__}") from None
            if self.ssl_context is not None:
                ssl_object = conn.transport.get_extra_info("ssl_object") if conn.transport else None
                if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
                    conn.close()
                    raise Unreachable(f"{self.label} did not agree to HTTP/2 (ALPN h2)")
            self._connections.append(conn)
            if self.closed:  # closed or drained while connecting: the calls that waited for it go, then it closes
                conn.going_away = True
            self._connecting.set_result(conn)
            return conn
        except BaseException as e:
            self._connecting.set_exception(e if isinstance(e, Exception) else Unreachable("connect cancelled"))
            self._connecting.exception()  # retrieved: a lone caller's error is not "never retrieved"
            raise
        finally:
            self._connecting = None

    def _dropped(self, conn: ClientConnection) -> None:
        with contextlib.suppress(ValueError):
            self._connections.remove(conn)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Close every connection (calls in flight end with :class:`Unreachable`)."""
        self.closed = True
        for conn in list(self._connections):
            conn.goodbye()

    def drain(self) -> None:
        """Take no new call, and close each connection once its calls in flight are answered (a server stopped
        on purpose finishes them); :meth:`close` still ends them at once."""
        self.closed = True
        for conn in list(self._connections):
            conn.drain()


__all__ = ["Answer", "Channel", "Unreachable"]
