"""ASGI apps on :class:`~octacloud.protocols.rest.server.Http1Server` connections, and their lifespan.

For the routes that are not worth a native handler (admin API, dashboard, metrics): the request's head becomes
an ASGI ``http`` scope, ``receive`` yields the body as it arrives (``http.disconnect`` once the client is gone),
and ``send`` takes ``http.response.start`` and ``http.response.body`` (with ``more_body``). A whole answer
(one body message) leaves in one write with its length; a streamed one is chunked. A ``connection: close`` the
app names closes the connection after the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from octacloud.protocols.asgi import ASGIApp, HttpError, Message, Scope
from octacloud.protocols.rest.request import Http1Request, encode_headers

_ASGI = {"version": "3.0", "spec_version": "2.3"}
Lifespan = tuple[asyncio.Task[None], asyncio.Queue[Message], asyncio.Queue[Message]]
"""A running lifespan conversation: the app's task, its inbox and its outbox."""


class AsgiBridge:
    """``await bridge(request)`` runs ``app`` for one request."""

    def __init__(self, app: ASGIApp, state: dict[str, Any] | None = None) -> None:
        self.app = app
        self.state = state if state is not None else {}

    async def __call__(self, request: Http1Request) -> None:
        scope: Scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": request.version,
            "method": request.method.decode("latin-1"),
            "scheme": request.scheme,
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": request.client,
            "server": None,
            "state": dict(self.state),
        }
        exchange = _Exchange(request)
        await self.app(scope, exchange.receive, exchange.send)


class _Exchange:
    __slots__ = ("close", "done", "ended", "headers", "length", "request", "status")

    def __init__(self, request: Http1Request) -> None:
        self.request = request
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.close = False
        self.length: int | None = None
        self.done = False
        self.ended = False
        """The body's end was delivered: a further ``receive`` waits for the client to go (ASGI's contract)."""

    async def receive(self) -> Message:
        request = self.request
        if self.ended and not self.done:
            await request.wait_disconnect()
        if self.done or self.ended or (request.disconnected and not request.complete):
            return {"type": "http.disconnect"}
        try:
            body, more = await request.receive()
        except HttpError:
            if request.too_large:
                raise
            return {"type": "http.disconnect"}
        self.ended = not more
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        request = self.request
        if kind == "http.response.start":
            if self.status:
                raise RuntimeError("http.response.start sent twice")
            self.status = int(message["status"])
            for name, value in message.get("headers", ()):
                name = bytes(name).lower()
                value = bytes(value)
                if name == b"connection":
                    self.close = self.close or b"close" in value.lower()
                    continue
                if name == b"content-length":
                    self.length = int(value)
                    continue
                if name == b"date":
                    continue
                self.headers.append((name, value))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.status:
            raise RuntimeError("http.response.body before http.response.start")
        if self.done:
            return
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        lines = encode_headers(self.headers)
        if not request.started and not more and not request.answered:
            self.done = True
            if request.method == b"HEAD" and self.length is not None:
                lines += b"content-length: %d\r\n" % self.length
                request.respond(self.status, lines, b"", close=self.close, has_length=True)
            else:
                request.respond(self.status, lines, body, close=self.close)
            return
        if not request.started:
            request.start(self.status, lines, self.length, close=self.close)
        request.write(body)
        if not more:
            self.done = True
            request.finish()


async def run_lifespan(app: ASGIApp) -> Lifespan:
    """Start ``app``'s lifespan conversation and wait for its startup; returns what :func:`end_lifespan` needs.
    An app that does not speak lifespan (raises at once) is served without it."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    scope: Scope = {"type": "lifespan", "asgi": _ASGI, "state": {}}

    async def run() -> None:
        await app(scope, inbox.get, outbox.put)

    task = asyncio.create_task(run())
    await inbox.put({"type": "lifespan.startup"})
    got = asyncio.create_task(outbox.get())
    await asyncio.wait({task, got}, return_when=asyncio.FIRST_COMPLETED)
    if got.done():
        message = got.result()
        if message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app failed to start: {message.get('message', '')}")
    else:
        got.cancel()
        task.result()  # raises why the app could not start
    return task, inbox, outbox


async def end_lifespan(handle: Lifespan, timeout: float = 10.0) -> None:
    task, inbox, outbox = handle
    if task.done():
        return
    await inbox.put({"type": "lifespan.shutdown"})
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while True:
                message = await outbox.get()
                if message["type"].startswith("lifespan.shutdown"):
                    break
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


__all__ = ["AsgiBridge", "Lifespan", "end_lifespan", "run_lifespan"]
