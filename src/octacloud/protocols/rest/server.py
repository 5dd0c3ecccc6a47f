"""A lean HTTP/1.1 server: one asyncio protocol per connection over ``httptools.HttpRequestParser``.

It serves the gateway and the replicas, whose every inference used to pay uvicorn's per-request cycle (a scope
dict, ASGI message dicts, header validation, two sends). A handler here gets an :class:`Http1Request` with the parsed
headers, decides on them alone (a refusal never reads the body), reads the body only when it wants it, and
answers with :meth:`Http1Request.respond` (``protocols/rest/request.py``): head and body in one ``write``.
:class:`AsgiBridge` runs an ASGI app on the same connections for the routes that are not worth a native handler.

What the server guarantees, whatever the handler does:

- answers leave in the order the requests arrived (pipelining): one handler runs per connection at a time;
- a connection over ``max_connections`` is closed as soon as it is accepted;
- a request's line and headers must arrive within ``header_timeout_s`` of the connection's start (or of the
  previous answer) and within ``max_header_bytes`` (431 and close beyond it); an idle keep-alive connection
  is closed after ``keep_alive_s``;
- a malformed request is answered 400 and the connection closed;
- a body is buffered up to ``max_body_bytes`` only; past it the reader gets 413 and the connection is closed;
  a body nobody reads is not read from the socket beyond a small buffer (reading pauses), and a handler that
  answers without reading it either closes the connection or lets the server drop the rest;
- ``Expect: 100-continue`` is answered when the handler first reads the body, never before;
- HTTP/1.0 and ``Connection: close`` clients get their answer and the connection closed; HEAD answers carry
  no body; every answer has a ``date`` header and no ``server`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from typing import Any, cast

import httptools

from octacloud.idlespin import poke
from octacloud.protocols.asgi import HttpError
from octacloud.protocols.rest.request import Handler, Http1Request, encode_headers, status_line

log = logging.getLogger(__name__)

_PAUSE_BYTES = 256 * 1024
"""Body bytes buffered for a handler that has not asked for them before reading from the socket pauses."""
_MAX_PIPELINE = 16
"""Requests parsed ahead of the one being answered before reading pauses."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 22\r\nconnection: close\r\n\r\n"
    b"Invalid HTTP request.\n"
)
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Http1Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for one at a time, writes answers in order."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        assert server.loop is not None, "Http1Server.start() sets the loop"
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pipeline: deque[Http1Request] = deque()
        self.parsing: Http1Request | None = None
        self.current: Http1Request | None = None
        self.task: asyncio.Task[None] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._in_head = False
        self._head_bytes = 0
        self._since = self.loop.time()
        """When the connection started or its last answer left: the header and keep-alive clocks start here."""
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._broken = False
        self._upgraded = False
        self._failure: bytes | None = None
        self._answered = False
        """An answer has left: from now on an idle connection is on the keep-alive clock."""
        self.closed = False

    # ---- asyncio protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if len(server.connections) >= server.max_connections or server.stopping:
            server.refused += 1
            self.closed = True
            self.transport.abort()
            return
        server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self._timer = self.loop.call_later(min(server.header_timeout_s, server.keep_alive_s), self._check_timers)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for request in (self.current, *self.pipeline):
            if request is not None:
                request.disconnected = True
                request._wake()
        self.server.idle_changed()

    def data_received(self, data: bytes) -> None:
        poke()
        if self._broken or self._upgraded:
            return
        if not self._in_head and self.parsing is None:
            self._in_head = True  # the first bytes of a request: its head is on the header clock now
            self._head_bytes = 0
        if self._in_head:
            room = self.server.max_header_bytes - self._head_bytes
            if len(data) > room and data.find(b"\r\n\r\n", 0, max(room, 0) + 4) == -1:
                self._fail(_TOO_LARGE)
                return
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded = True  # no protocol switch is offered: answer the request, then close
            if self.parsing is not None:
                self.parsing.complete = True
                self.parsing.keep_alive = False
                self.parsing._wake()
                self.parsing = None
        except httptools.HttpParserError:
            self._fail(_BAD_REQUEST)

    def eof_received(self) -> bool | None:
        return None

    def _fail(self, answer: bytes) -> None:
        """A request that cannot be parsed: answer ``answer`` once the answers before it are out, and close."""
        self._broken = True
        self._in_head = False
        if self.parsing is not None and not self.parsing.complete:
            self.parsing.disconnected = True
            self.parsing._wake()
        if self.current is None:
            self.write(answer)
            self.close()
        else:
            self._failure = answer

    # ---- httptools callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        request = Http1Request(self, parser.get_method(), self._url, self._headers)
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        for name, value in self._headers:
            if name == b"expect" and value.lower() == b"100-continue":
                request.expect_continue = True
        self.parsing = request
        if self.current is None:
            self._run(request)
        else:
            self.pipeline.append(request)
            if len(self.pipeline) >= _MAX_PIPELINE:
                self._pause()

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        if request is None or request.too_large or request.answered:
            return  # answered without reading it: the rest of the body is dropped as it arrives
        request.size += len(body)
        if request.size > self.server.max_body_bytes:
            request.too_large = True
            request._chunks = []
            request._wake()
            self._pause()
            return
        request._chunks.append(body)
        if request._waiter is not None:
            request._wake()
        elif request.size > _PAUSE_BYTES:
            self._pause()

    def on_message_complete(self) -> None:
        request = self.parsing
        if request is None:
            return
        self.parsing = None
        request.complete = True
        request._wake()
        if request is self.current and self.task is None:
            self._next()  # its handler finished before the body's end: the next request can run now

    # ---- running handlers -------------------------------------------------------------------------------

    def _run(self, request: Http1Request) -> None:
        self.current = request
        self.task = task = self.loop.create_task(self.server.handler(request))
        task.add_done_callback(self._handled)

    def _handled(self, task: asyncio.Task[None]) -> None:
        request = self.current
        self.task = None
        if request is None:
            return
        if task.cancelled():
            exc: BaseException | None = None
            if not request.answered:
                request.closing = True
                self._answer_error(request, 503, "the server is stopping")
        else:
            exc = task.exception()
        if exc is not None:
            if isinstance(exc, HttpError) and not request.answered:
                self._answer_error(request, exc.status, str(exc), exc.headers, close=True)
            else:
                if not isinstance(exc, HttpError):
                    log.error("error answering %s %s", request.method.decode(), request.path, exc_info=exc)
                if not request.answered:
                    self._answer_error(request, 500, "internal server error", close=True)
                else:
                    request.closing = True
        elif not request.answered:
            self._answer_error(request, 500, "the handler sent no answer", close=True)
        elif request.started:
            request.finish()
        if request.closing or self._upgraded:
            self.close()
            return
        if not request.complete and not request.disconnected:
            # Answered without reading the whole body: drop the rest as it arrives, then run the next request.
            request._chunks = []
            self._resume()
            self._since = self.loop.time()
            return
        self._next()

    def _answer_error(
        self,
        request: Http1Request,
        status: int,
        message: str,
        headers: list[tuple[bytes, bytes]] | None = None,
        close: bool = False,
    ) -> None:
        body = b'{"error": ' + _json_string(message) + b"}"
        lines = encode_headers([(b"content-type", b"application/json"), *(headers or [])])
        request.respond(status, lines, body, close=close)

    def _next(self) -> None:
        self.current = None
        self._answered = True
        self._since = self.loop.time()
        failure = self._failure
        if self.pipeline:
            self._run(self.pipeline.popleft())
            if len(self.pipeline) < _MAX_PIPELINE // 2:
                self._resume()
        elif failure is not None:
            self.write(failure)
            self.close()
        else:
            self._resume()
            self.server.idle_changed()

    def want_body(self, request: Http1Request) -> None:
        """The handler waits for body bytes: answer ``100 Continue`` once, and read from the socket again."""
        if request.expect_continue:
            request.expect_continue = False
            if not request.answered:
                self.write(_CONTINUE)
        self._resume()

    # ---- transport --------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.closed:
            transport.write(data)

    def _pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    @property
    def idle(self) -> bool:
        """No request is being answered and none has begun arriving."""
        return self.current is None and not self._in_head and self.parsing is None

    def body_deadline(self, deadline: float) -> None:
        """Make the connection's timer fire by ``deadline`` (it usually does already: no timer is made)."""
        timer = self._timer
        if timer is not None and timer.when() <= deadline:
            return
        if timer is not None:
            timer.cancel()
        self._timer = self.loop.call_at(deadline, self._check_timers)

    def _check_timers(self) -> None:
        """One timer per connection, re-armed lazily: the header clock and the keep-alive clock."""
        self._timer = None
        if self.closed:
            return
        server = self.server
        now = self.loop.time()
        current = self.current
        if current is not None and not (self.task is None and not current.complete):
            due = now + server.keep_alive_s  # a request is being answered: only its body's time is bounded here
            if current.deadline:
                if now >= current.deadline:
                    current.timed_out = True
                    current._wake()
                else:
                    due = min(due, current.deadline)
        elif self._in_head or self.parsing is not None:
            due = self._since + server.header_timeout_s
        elif self._answered:
            due = self._since + server.keep_alive_s
        else:  # no request yet: a new connection is on the header clock, as uvicorn's bound had it
            due = self._since + server.header_timeout_s
        if now >= due:
            self.close()
            return
        self._timer = self.loop.call_at(due, self._check_timers)


def _json_string(text: str) -> bytes:
    return json.dumps(text).encode()


class Http1Server:
    """Listens on a bound socket and serves ``handler`` with the bounds described in this module's docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int = 10_000,
        max_header_bytes: int = 64 * 1024,
        max_body_bytes: int = 64 * 2**20,
        header_timeout_s: float = 10.0,
        keep_alive_s: float = 5.0,
    ) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.keep_alive_s = keep_alive_s
        self.connections: set[Http1Connection] = set()
        self.refused = 0
        """Connections closed on arrival because ``max_connections`` were open."""
        self.stopping = False
        self.scheme = "http"
        self._server: asyncio.Server | None = None
        self._idle_event: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self, sock: Any, ssl: Any = None, backlog: int = 2048) -> int:
        """Serve on ``sock`` (bound, listening or not); returns its port."""
        self.loop = asyncio.get_running_loop()
        self.scheme = "https" if ssl is not None else "http"
        handshake = self.header_timeout_s if ssl is not None else None
        self._server = await self.loop.create_server(
            lambda: Http1Connection(self), sock=sock, ssl=ssl, backlog=backlog, ssl_handshake_timeout=handshake
        )
        port: int = sock.getsockname()[1]
        return port

    def idle_changed(self) -> None:
        if self._idle_event is not None:
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            if not self.connections:
                self._idle_event.set()

    async def stop(self, grace: float) -> None:
        """Stop accepting, close idle connections, give answers in progress up to ``grace`` s, then close all."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        self._idle_event = asyncio.Event()
        self.idle_changed()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._idle_event.wait()
        for conn in list(self.connections):
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()
            conn.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1):
                    await self._server.wait_closed()
            self._server = None


__all__ = ["Handler", "Http1Connection", "Http1Request", "Http1Server", "encode_headers", "status_line"]
