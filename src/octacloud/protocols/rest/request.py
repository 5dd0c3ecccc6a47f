"""One HTTP/1.1 request on a :mod:`~octacloud.protocols.rest.server` connection: its head, its body as it
arrives, and the ways to answer it (whole in one ``write``, or streamed), with the status lines and ``date``
header the answers share."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from octacloud.protocols.asgi import HttpError

if TYPE_CHECKING:
    from octacloud.protocols.rest.server import Http1Connection

Handler = Callable[["Http1Request"], Coroutine[Any, Any, None]]
"""Answers one request (``respond`` or ``start``/``write``/``finish``); may raise :class:`HttpError`."""

NO_BODY_STATUS = frozenset({204, 304})
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


class _Date:
    """The ``date`` header line, formatted once a second."""

    __slots__ = ("line", "second")

    def __init__(self) -> None:
        self.second = 0
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.line


_DATE = _Date()


def encode_headers(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...]) -> bytes:
    """``name: value\\r\\n`` lines; refuses names or values that would split the head (CR, LF, NUL)."""
    out = []
    for name, value in headers:
        if b"\r" in value or b"\n" in value or b"\0" in value or b":" in name or b"\r" in name or b"\n" in name:
            raise ValueError(f"invalid header {name!r}")
        out += [name, b": ", value, b"\r\n"]
    return b"".join(out)


class Http1Request:
    """One request on a connection: its head, its body as it arrives, and the ways to answer it."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_paused",
        "_waiter",
        "answered",
        "chunked",
        "closing",
        "complete",
        "deadline",
        "disconnected",
        "expect_continue",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_path",
        "size",
        "started",
        "timed_out",
        "too_large",
        "version",
    )

    def __init__(self, conn: Http1Connection, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn = conn
        self.method = method
        self.headers = headers
        """(lowercase name, value) in arrival order."""
        target, _, self.query = url.partition(b"?")
        self.raw_path = target
        text = target.decode("latin-1")
        self.path = unquote(text) if "%" in text else text
        self.version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.chunked = False
        self.complete = False
        self.too_large = False
        self.disconnected = False
        self.deadline = 0.0
        """While the handler waits for the body: when its time runs out (the connection's timer checks it)."""
        self.timed_out = False
        self.size = 0
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.answered = False
        """The answer (or its head) has been written."""
        self.started = False
        self.closing = False
        """The connection closes after this answer."""

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def client(self) -> tuple[str, int] | None:
        return self._conn.peer

    @property
    def scheme(self) -> str:
        return self._conn.server.scheme

    # ---- the body ---------------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._conn.want_body(self)
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_disconnect(self) -> None:
        """Until the client goes away."""
        while not self.disconnected:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_body(self, timeout: float) -> bytes:
        """The whole body within ``timeout`` seconds (``TimeoutError`` after it); :class:`HttpError` 413 past the
        server's ``max_body_bytes``, 400 when the client goes away before its end."""
        if not self.complete:
            conn = self._conn
            self.deadline = conn.loop.time() + timeout  # no timer of its own: the connection's checks it
            conn.body_deadline(self.deadline)
            while not (self.complete or self.too_large or self.disconnected or self.timed_out):
                await self._wait()
            self.deadline = 0.0
            if self.timed_out and not self.complete:
                raise TimeoutError
        if self.too_large:
            raise HttpError(413, f"request body is over the limit of {self._conn.server.max_body_bytes} bytes")
        if not self.complete:
            raise HttpError(400, "the client disconnected before the end of the body")
        chunks = self._chunks
        self._chunks = []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive(self) -> tuple[bytes, bool]:
        """The body's next bytes and whether more follow (for streaming readers such as ASGI apps)."""
        while not (self._chunks or self.complete or self.too_large or self.disconnected):
            await self._wait()
        if self.too_large:
            raise HttpError(413, f"request body is over the limit of {self._conn.server.max_body_bytes} bytes")
        if self._chunks:
            chunks = self._chunks
            self._chunks = []
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            return data, not self.complete
        if not self.complete:
            raise HttpError(400, "the client disconnected before the end of the body")
        return b"", False

    # ---- the answer -------------------------------------------------------------------------------------

    def respond(self, status: int, headers: bytes, body: bytes, close: bool = False, has_length: bool = False) -> None:
        """Write the whole answer in one ``write``: status line, ``headers`` (encoded ``name: value\\r\\n``
        lines), ``date``, ``content-length`` (unless ``has_length``: the caller's lines carry one, as a HEAD
        answer's do), ``connection: close`` when the connection ends after it, and the body (none for HEAD)."""
        if self.answered:
            raise RuntimeError("the request was already answered")
        self.answered = True
        if close or not self.keep_alive:
            self.closing = True
        parts = [status_line(status), headers, _DATE.get()]
        if not has_length and status not in NO_BODY_STATUS and status >= 200:
            parts += [b"content-length: ", str(len(body)).encode(), b"\r\n"]
        if self.closing:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if self.method != b"HEAD" and status not in NO_BODY_STATUS:
            parts.append(body)
        self._conn.write(b"".join(parts))

    def start(self, status: int, headers: bytes, length: int | None, close: bool = False) -> None:
        """Write a streamed answer's head; ``length`` None: chunked (HTTP/1.1) or until the close (HTTP/1.0)."""
        if self.answered:
            raise RuntimeError("the request was already answered")
        self.answered = self.started = True
        if close or not self.keep_alive:
            self.closing = True
        parts = [status_line(status), headers, _DATE.get()]
        if length is not None:
            parts += [b"content-length: ", str(length).encode(), b"\r\n"]
        elif self.version == "1.1":
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            self.closing = True
        if self.closing:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._conn.write(b"".join(parts))
        self.chunked = length is None and self.version == "1.1"

    def write(self, data: bytes) -> None:
        if not data or self.method == b"HEAD":
            return
        if self.chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)

    def finish(self) -> None:
        if self.chunked and self.method != b"HEAD":
            self._conn.write(b"0\r\n\r\n")
        self.chunked = False
