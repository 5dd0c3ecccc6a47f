"""gRPC over HTTP/2 on the event loop itself: a lean server for Triton's ``GRPCInferenceService``.

Why not ``grpc.aio``: it hands every call event from grpc's poller thread to the event loop through a socket
(about five loop wake-ups and eleven system calls per unary call, measured); under load the loop spends its
time being woken instead of batching, and the process burns two to three times Triton's CPU per inference.
Here one read brings a request's frames, the servicer coroutine runs on the loop, and one write sends the
response's HEADERS, DATA and trailers (the responses of one batch on one connection share that write).
HPACK comes from the maintained ``hpack`` package; the rest of HTTP/2 that a gRPC server needs (RFC 9113:
settings, ping, flow control both ways, CONTINUATION, padding, RST_STREAM, GOAWAY) is here and in its parts:
``h2_frames`` (framing), ``h2_calls`` (a call's context, methods and hooks), ``h2_connection`` and ``h2_output``
(a connection's reading and answering halves), ``h2_limits`` (what a client may cost, and the frames it may
send).

The methods are :class:`~octacloud.protocols.grpc.servicer.InferenceServicer`'s, called with a context whose
``abort`` ends the call with that status; so both servers answer alike.

:class:`Http2Server` is the same server for any set of methods, among them *raw* ones (``Method.parse`` is
None) that get the request message's bytes and answer bytes, never decoding a message: the cloud's gateway
proxies calls that way. Its ``admit`` hook sees each call's path and metadata before one byte of the message
is read (and may refuse it), its ``gate`` sees a unary call's whole message in the frame handling, before any
task (and may refuse it with one trailers-only HEADERS frame); a message whose length prefix is over the limit
is refused before its body arrives; calls in progress, streams per connection and connections are bounded, and
what calls hold before their message completes as ``h2_limits`` says; a connection that has not sent its
preface within ``header_timeout_s``, or has had no call for ``idle_timeout_s``, is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as _ssl  # ``start``'s parameter is named ssl, as asyncio's
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from octacloud.protocols.grpc.h2_calls import Admit, CallContext, Gate, Metadata, Method, Refusal, methods
from octacloud.protocols.grpc.h2_calls import require_secret as require_secret
from octacloud.protocols.grpc.h2_calls import server_ssl_context as server_ssl_context
from octacloud.protocols.grpc.h2_connection import Http2Connection
from octacloud.protocols.grpc.h2_frames import DATA as DATA
from octacloud.protocols.grpc.h2_frames import DEFAULT_FRAME, metadata_block
from octacloud.protocols.grpc.h2_frames import END_HEADERS as END_HEADERS
from octacloud.protocols.grpc.h2_frames import END_STREAM as END_STREAM
from octacloud.protocols.grpc.h2_frames import FRAME_SIZE_ERROR as FRAME_SIZE_ERROR
from octacloud.protocols.grpc.h2_frames import GOAWAY as GOAWAY
from octacloud.protocols.grpc.h2_frames import HEADERS as HEADERS
from octacloud.protocols.grpc.h2_frames import PREFACE as PREFACE
from octacloud.protocols.grpc.h2_frames import REFUSED_STREAM as REFUSED_STREAM
from octacloud.protocols.grpc.h2_frames import RST_STREAM as RST_STREAM
from octacloud.protocols.grpc.h2_frames import SETTINGS as SETTINGS
from octacloud.protocols.grpc.h2_frames import TurnOutput as TurnOutput
from octacloud.protocols.grpc.h2_limits import Http2Limits, InputBudget, Rate
from octacloud.protocols.grpc.servicer import InferenceServicer
from octacloud.protocols.headers import REPLICA_MAX_HEADER_BYTES
from octacloud.protocols.internal import HANDSHAKE_TIMEOUT_S
from octacloud.serving import DataPlane

log = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG, keys and secrets among them: never let those records out
logging.getLogger("hpack").setLevel(logging.INFO)

REPLICA_LIMITS = Http2Limits(resets=None)
"""A cloud's replica: its client is the gateway, whose calls are cancelled when its own clients' are (each
bounded at the gateway), so the resets on its connection are not the replica's to bound."""


class Http2Server:
    """gRPC over HTTP/2 for a set of methods (by path), on the running event loop."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        *,
        admit: Admit | None = None,
        gate: Gate | None = None,
        release: Callable[[Any], None] | None = None,
        max_message_bytes: int = 64 * 2**20,
        max_streams: int = 1024,
        max_calls: int = 2**31,
        max_connections: int = 2**31,
        header_timeout_s: float = 3600.0,
        idle_timeout_s: float = 86400.0,
        max_header_bytes: int = REPLICA_MAX_HEADER_BYTES,
        limits: Http2Limits | None = None,
        owner: Callable[[Any], Hashable] | None = None,
    ) -> None:
        self.methods = dict(methods)
        self.admit = admit
        self.gate = gate
        """Unary calls: see :data:`Gate`."""
        self.release = release
        """``release(state)`` once a unary call that passed the gate has finished, however it ended (the
        gate's state, e.g. a slot it reserved)."""
        self.max_message_bytes = max_message_bytes
        self.max_streams = max_streams
        """Concurrent streams per connection (our SETTINGS_MAX_CONCURRENT_STREAMS; more are REFUSED_STREAM)."""
        self.max_calls = max_calls
        """Calls in progress over all connections; more are RESOURCE_EXHAUSTED."""
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        """From a connection's start to the end of the client's preface."""
        self.idle_timeout_s = idle_timeout_s
        """A connection with no call for this long is sent GOAWAY and closed."""
        self.limits = limits or Http2Limits()
        """What a connection may hold before its calls complete, and the frames it may send (``h2_limits``)."""
        self.owner = owner
        """``owner(state)``: whose budget a call's input is held on (``h2_limits``), from what ``admit`` returned
        (e.g. the caller's tenant); when it returns None (a caller without a key), the call's connection is its
        owner, so that no one caller can spend a budget that others without a key share. No hook: every call's
        is one owner's."""
        self.inputs = InputBudget(self.limits)
        self.max_header_bytes = max_header_bytes
        """A call's header list as HTTP/2 counts it (our SETTINGS_MAX_HEADER_LIST_SIZE); a larger one is refused
        RESOURCE_EXHAUSTED on its stream (see ``protocols.headers`` for each hop's)."""
        self.max_frame_in = DEFAULT_FRAME  # we advertise no larger SETTINGS_MAX_FRAME_SIZE
        self.connections: set[Http2Connection] = set()
        self.calls = 0
        self.refused = 0
        """Connections closed on arrival because ``max_connections`` were open."""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.now: Callable[[], float] = lambda: 0.0

    async def start(
        self,
        host: str,
        port: int,
        ssl: _ssl.SSLContext | None = None,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
    ) -> int:
        """Listen on ``host:port`` (0: a free port), over TLS when ``ssl`` is given (it must offer ALPN ``h2``:
        :func:`server_ssl_context`); ``reuse_port``: share the port with other processes (``SO_REUSEPORT``);
        ``sock``: listen on this bound socket instead (``host`` and ``port`` are then ignored). Returns the port."""
        loop = asyncio.get_running_loop()
        self.now = loop.time
        handshake = min(self.header_timeout_s, HANDSHAKE_TIMEOUT_S)
        tls: dict[str, Any] = {"ssl": ssl, "ssl_handshake_timeout": handshake} if ssl is not None else {}
        try:
            if sock is not None:
                self._server = await loop.create_server(lambda: Http2Connection(self), sock=sock, **tls)
            else:
                self._server = await loop.create_server(
                    lambda: Http2Connection(self), host, port, reuse_address=True, reuse_port=reuse_port or None, **tls
                )
        except OSError as e:
            raise OSError(f"cannot bind the gRPC port {host}:{port}: {e.strerror}") from None
        self._sweeper = loop.create_task(self._sweep())
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def _sweep(self) -> None:
        interval = min(1.0, self.header_timeout_s / 2, self.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(interval)
            now = self.now()
            for c in list(self.connections):
                c.sweep(now)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, tell every client to go away, give calls in flight ``grace_s`` to finish."""
        if self._server is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._server.close()
        for c in list(self.connections):
            c.shut_down()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c._close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 1)
        self._server = None


class GrpcServer(Http2Server):
    """Triton's gRPC service over one :class:`DataPlane`, on the running event loop."""

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        max_message_bytes: int = 64 * 2**20,
        max_streams: int = 1024,
        extra: Mapping[str, Method] | None = None,
        secret: bytes | None = None,
        replica_id: str = "",
    ) -> None:
        super().__init__(
            {**methods(InferenceServicer(dataplane, trust_tenant=secret is not None)), **(extra or {})},
            admit=None if secret is None else require_secret(secret, replica_id),
            max_message_bytes=max_message_bytes,
            max_streams=max_streams,
            limits=REPLICA_LIMITS,
        )
        self.secret = secret
        """The cloud's internal secret: every call but ServerLive/ServerReady must carry it (protocols/internal.py);
        a call meant for another replica than ``replica_id`` is UNAVAILABLE (the caller tries another)."""


__all__ = [
    "REPLICA_LIMITS",
    "Admit",
    "CallContext",
    "Gate",
    "GrpcServer",
    "Http2Connection",
    "Http2Limits",
    "Http2Server",
    "Metadata",
    "Method",
    "Rate",
    "Refusal",
    "metadata_block",
    "methods",
    "require_secret",
    "server_ssl_context",
]
