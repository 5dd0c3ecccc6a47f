"""uvicorn's httptools HTTP/1.1 protocol, sending each response's head and body in one ``write``.

uvicorn writes the status line and headers as soon as the app sends ``http.response.start``, then the body on
``http.response.body``: two ``send`` system calls per response, and the first (which wakes the client) was
17 % of a replica's CPU under load. Here the head is held until the body's write joins it; a head that no
body follows in the same loop iteration (``100 Continue``, a streamed response) goes out at the end of it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeldHeadTransport:
    """A transport whose ``write`` of a response head waits for the next write (or the loop's next turn)."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + bytes(data))
        elif data[:5] == b"HTTP/" and bytes(data[-4:]) == b"\r\n\r\n":
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """``uvicorn.Config(http=OneWriteHttpToolsProtocol)``: httptools parsing, one write per response."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, _HeldHeadTransport(transport, self.loop)))


__all__ = ["OneWriteHttpToolsProtocol"]
