"""uvicorn's httptools protocol with the bounds a proxy facing strangers needs, and the gateway's connection cap.

The gateway's own REST front no longer runs on uvicorn (``fronts.RestFront`` serves ``protocols/rest/server.py``,
which enforces the same bounds itself); ``connection_cap`` sizes both, and ``bounded_protocol`` stays for tools
that serve the gateway's ASGI app under uvicorn (``bench/overload.py``).

uvicorn parses and frames requests (and answers ``Expect: 100-continue`` itself when the app first reads the
body, that is after the gateway checked the key on the headers). It has a keep-alive timeout but no bound on
the time to send headers and none on the number of connections, so a client that opens connections and
sends nothing (or one byte every few seconds) holds file descriptors forever. This protocol adds both:

- a connection over ``max_connections`` (or over what the process's file limit leaves, less a reserve for
  connections to replicas and files) is closed as soon as it is accepted;
- a request's headers must be complete within ``header_timeout_s`` of the connection's start (or of the
  previous answer on it), and within ``max_header_bytes`` (431); otherwise the connection is closed.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

from octacloud.cluster.gateway.limits import GatewayLimits
from octacloud.protocols.rest.h1 import OneWriteHttpToolsProtocol

_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
FD_RESERVE = 512
"""File descriptors kept for what is not a client connection (replica connections, the store, logs)."""


def connection_cap(limits: GatewayLimits) -> int:
    """``max_connections``, or fewer when the process's file limit would run out first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(16, min(limits.max_connections, soft - FD_RESERVE))


def bounded_protocol(limits: GatewayLimits) -> type[asyncio.Protocol]:
    """A uvicorn ``http`` protocol class enforcing ``limits``' connection count and header time."""
    cap = connection_cap(limits)

    class BoundedHttpToolsProtocol(OneWriteHttpToolsProtocol):  # each response in one write
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        """Bytes received since the current request began, while its headers are incomplete."""
        refused = 0
        """Connections closed on arrival because ``max_connections`` were open (for tests and metrics)."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                type(self).refused += 1
                transport.abort()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:  # waiting for a request's headers
                room = limits.max_header_bytes - self._header_bytes
                if len(data) > room and data.find(b"\r\n\r\n", 0, max(room, 0) + 4) == -1:
                    self._disarm_header_timer()
                    self.transport.write(_TOO_LARGE)
                    self.transport.close()
                    return
                self._header_bytes += len(data)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            waiting = bool(self.pipeline)  # a pipelined request whose headers are already complete runs next
            super().on_response_complete()
            if not waiting and not self.transport.is_closing():
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedHttpToolsProtocol
