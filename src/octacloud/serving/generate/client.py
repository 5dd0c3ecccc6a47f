"""A streaming HTTP/1.1 client: one request per connection, the answer's body handed on as its bytes arrive.

Generation streams tokens for seconds, so the hops of a generative request (the replica to its engine, the
gateway to the replica) relay the answer while it is produced, never buffer it whole. One connection carries one
exchange and is closed after it: closing it is how a hop tells the next one that its client went away, which
is how a disconnect reaches the engine and stops the generation (llama-server checks its connection between
tokens). ``httptools`` parses; bodies are de-chunked, so what :meth:`Answer.chunks` yields is the payload.

The reader applies back-pressure: while more than ``MAX_BUFFERED`` chunks wait for the consumer, the socket is
not read, so a slow client slows the engine's stream instead of growing this process's memory.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import cast

import httptools

MAX_BUFFERED = 64
"""Chunks held for a slow consumer before the connection stops being read."""


class StreamError(Exception):
    """The other side could not be reached, sent a malformed answer, or closed before the answer's end."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where to connect: a Unix socket ``path``, or ``host``/``port`` (with TLS when ``tls`` is given)."""

    host: str = "127.0.0.1"
    port: int = 0
    path: str = ""
    tls: ssl.SSLContext | None = None
    server_name: str | None = None

    @property
    def label(self) -> str:
        return self.path or f"{self.host}:{self.port}"


class _Reader(asyncio.Protocol):
    """Parses one answer; the head completes ``head``, body chunks queue up for :class:`Answer`."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.done = False
        self.error: StreamError | None = None
        self._wake: asyncio.Future[None] | None = None
        self._paused = False
        self._until_eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(StreamError(f"{self.label} sent a malformed answer: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        if self.head.done() and not self.done and self._until_eof:
            self._end()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done:
            self._fail(StreamError(f"{self.label} closed the connection before the end of its answer"))

    # ---- httptools callbacks ----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the final one follows
            self.headers = []
            return
        self.status = status
        names = {n for n, _ in self.headers}
        chunked = any(n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in self.headers)
        self._until_eof = b"content-length" not in names and not chunked and status not in (204, 304)
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.status:
            self.chunks.append(body)
            if len(self.chunks) > MAX_BUFFERED and self.transport is not None and not self._paused:
                self._paused = True
                self.transport.pause_reading()
            self._notify()

    def on_message_complete(self) -> None:
        if self.status:
            self._end()

    # ---- state ------------------------------------------------------------------------------------------
    def _end(self) -> None:
        self.done = True
        self._notify()
        self.close()

    def _fail(self, error: StreamError) -> None:
        self.done = True
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next_chunk(self) -> bytes | None:
        """The next body bytes, None at the body's end; raises :class:`StreamError` when the answer broke off."""
        while not self.chunks:
            if self.done:
                if self.error is not None:
                    raise self.error
                return None
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        chunk = self.chunks.popleft()
        if self._paused and len(self.chunks) <= MAX_BUFFERED // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Answer:
    """An answer whose head has arrived: ``status``, ``headers`` (lower-case names) and the body to come."""

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader
        self.status = reader.status
        self.headers = reader.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the connection is closed when the iteration ends, whichever way."""
        try:
            while (chunk := await self._reader.next_chunk()) is not None:
                yield chunk
        finally:
            self._reader.close()

    async def read(self, limit: int = 64 * 2**20) -> bytes:
        """The whole body (at most ``limit`` bytes, else :class:`StreamError`)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise StreamError(f"the answer of {self._reader.label} is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection (the other side sees its client go)."""
        self._reader.close()


def encode(method: bytes, target: bytes, host: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    head = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\nconnection: close\r\n"]
    for name, value in headers:
        head += [name, b": ", value, b"\r\n"]
    if body or method not in (b"GET", b"HEAD"):
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n"]
    head += [b"\r\n", body]
    return b"".join(head)


async def request(
    target: Target,
    method: bytes,
    path: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    connect_timeout: float = 2.0,
    head_timeout: float | None = None,
) -> Answer:
    """Send one request and return once the answer's head has arrived (within ``head_timeout`` seconds, else
    ``TimeoutError``: the connection is closed). Raises :class:`StreamError` when it cannot connect or the
    answer breaks off before its head."""
    loop = asyncio.get_running_loop()
    label = target.label
    try:
        if target.path:
            connect = loop.create_unix_connection(lambda: _Reader(label), target.path)
        else:
            name = (target.server_name or target.host) if target.tls is not None else None
            connect = loop.create_connection(
                lambda: _Reader(label), target.host, target.port, ssl=target.tls, server_hostname=name
            )
        _, reader = await asyncio.wait_for(connect, connect_timeout)
    except (OSError, TimeoutError) as exc:
        raise StreamError(f"cannot connect to {label}: {exc or type(exc).__name__}") from None
    assert reader.transport is not None
    host = target.host.encode() if not target.path else b"localhost"
    reader.transport.write(encode(method, path, host, headers, body))
    try:
        async with asyncio.timeout(head_timeout):
            await reader.head
    except BaseException:
        reader.close()
        raise
    return Answer(reader)
