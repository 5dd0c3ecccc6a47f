"""What every raw ASGI front end of octacloud shares: request bodies read under limits, replies, lifespan.

The replica's OIP app and the cloud's gateway are both lean ASGI apps (no framework on the hot path). Both
must refuse a body that is too large from its ``Content-Length`` before reading it, stop reading one that
grows past the limit, and answer in the same shape: ``{"error": "<message>"}`` with a status that says who
was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from http import HTTPStatus
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
JSON = (b"content-type", b"application/json")


class HttpError(Exception):
    """A request the front end refuses: ``status`` (4xx: the client's fault) and a message for the client."""

    def __init__(self, status: int, message: str, headers: Headers = ()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)


def reason(status: int) -> str:
    """The standard reason phrase of ``status`` ('' for a code HTTP does not name)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def header(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI servers give them), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def content_length(headers: Headers, limit: int) -> int | None:
    """The announced body size (None when there is none: chunked or no body); raises :class:`HttpError`
    400 for a malformed or conflicting length, 413 for one over ``limit`` (before any byte is read)."""
    lengths = {value.strip() for key, value in headers if key == b"content-length"}
    if not lengths:
        return None
    if len(lengths) > 1:
        raise HttpError(400, "conflicting Content-Length headers")
    (value,) = lengths
    if not value.isdigit() or len(value) > 19:
        raise HttpError(400, f"Content-Length must be a number of bytes, got {value[:40].decode('latin-1')!r}")
    length = int(value)
    if length > limit:
        raise HttpError(413, f"request body of {length} bytes is over the limit of {limit} bytes")
    return length


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; :class:`HttpError` 413 as soon as it grows past ``limit``, 400 when the client
    goes away before its end."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(400, "the client disconnected before the end of the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def reply(send: Send, status: int, body: bytes, headers: Headers = (JSON,)) -> int:
    """Send a whole answer with its length; returns the body's size."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return len(body)


async def json_reply(send: Send, status: int, payload: object, headers: Headers = ()) -> int:
    return await reply(send, status, json.dumps(payload).encode(), [JSON, *headers])


async def error_reply(send: Send, error: HttpError, headers: Headers = ()) -> int:
    return await json_reply(send, error.status, {"error": str(error)}, [*error.headers, *headers])


async def lifespan(receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
    """Answer an ASGI lifespan conversation (startup at once; ``on_shutdown`` before shutdown completes)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if on_shutdown is not None:
                await on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
