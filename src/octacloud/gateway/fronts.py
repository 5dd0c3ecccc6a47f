"""The gateway's front servers, built in one place: the REST gateway on octacloud's HTTP/1.1 server and the gRPC
gateway on octacloud's HTTP/2 server.

The single-process cloud and each gateway worker process (``gateway.workers``) start their fronts here, so both
serve with the same bounds, TLS and options. Each front has the same small shape: ``await start(host, port,
reuse_port)`` returns the bound port (0 picks a free one), ``await stop(grace)`` stops it. With ``reuse_port``
the listening socket sets ``SO_REUSEPORT``: several processes of the same user then listen on one port and the
kernel spreads new connections over them.
"""

from __future__ import annotations

import resource
import socket
import ssl
from dataclasses import dataclass
from typing import Protocol

from octacloud.gateway.grpc_proxy import MAX_STREAMS, GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.protocols.asgi import ASGIApp
from octacloud.protocols.grpc.h2 import Http2Limits, Http2Server, server_ssl_context
from octacloud.protocols.rest.bridge import AsgiBridge, Lifespan, end_lifespan, run_lifespan
from octacloud.protocols.rest.server import Http1Server
from octacloud.security.tls import TlsConfig

BACKLOG = 2048
FD_RESERVE = 512
"""File descriptors kept for what is not a client connection (replica connections, the store, logs)."""


def connection_cap(limits: GatewayLimits) -> int:
    """``max_connections``, or fewer when the process's file limit would run out first: a connection over it is
    closed as soon as it is accepted."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(16, min(limits.max_connections, soft - FD_RESERVE))


class Front(Protocol):
    """One listening server. ``start`` raises (e.g. OSError: port in use) when it cannot listen; ``stop`` waits up to
    ``grace`` seconds for requests in progress, and may be called after a failed or without a start."""

    async def start(self, host: str, port: int, reuse_port: bool) -> int: ...

    async def stop(self, grace: float) -> None: ...


def bind_socket(host: str, port: int, reuse_port: bool, reuse_addr: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEPORT`` set when asked), not yet listening.

    Bound but not listening (and without ``reuse_addr``), it reserves the port (and names the one the kernel
    picked for port 0) for processes that then listen on it with ``SO_REUSEPORT``: a socket that does not listen
    takes no connections, and one without ``SO_REUSEPORT`` cannot bind the port meanwhile."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        if reuse_addr:  # a restarted server binds at once, past its old connections in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


class RestFront:
    """The REST gateway on octacloud's HTTP/1.1 server (``protocols/rest/server.py``) with the gateway's bounds
    and TLS. An app with a native ``serve_http1`` handler (``RestGateway``) answers inference without the ASGI
    cycle; any other ASGI app (the admin API of a worker hub) runs through :class:`AsgiBridge`. The app's ASGI
    lifespan runs as uvicorn's ``lifespan="on"`` did: startup before the port serves, shutdown after it stops."""

    def __init__(self, app: ASGIApp, limits: GatewayLimits, tls: TlsConfig | None = None) -> None:
        self.app = app
        self.limits = limits
        self.tls = tls
        self.server: Http1Server | None = None
        self._lifespan: Lifespan | None = None

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        sock = bind_socket(host, port, reuse_port)
        try:
            sock.listen(BACKLOG)
            limits = self.limits
            handler = getattr(self.app, "serve_http1", None) or AsgiBridge(self.app)
            server = Http1Server(
                handler,
                max_connections=connection_cap(limits),
                max_header_bytes=limits.max_header_bytes,
                max_body_bytes=limits.max_body_bytes,
                header_timeout_s=limits.header_timeout_s,
                keep_alive_s=limits.keep_alive_s,
            )
            self._lifespan = await run_lifespan(self.app)
            bound = await server.start(sock, ssl=rest_ssl_context(self.tls), backlog=BACKLOG)
        except BaseException:
            sock.close()  # on success the server owns it
            if self._lifespan is not None:
                await end_lifespan(self._lifespan)
                self._lifespan = None
            raise
        self.server = server
        return bound

    async def stop(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self._lifespan is not None:
            await end_lifespan(self._lifespan)
            self._lifespan = None


def rest_ssl_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """The REST front's TLS context for the cloud's certificate (client certificates when the cloud requires them)."""
    if tls is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tls.certfile), str(tls.keyfile))
    if tls.client_ca is not None:
        context.load_verify_locations(str(tls.client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["http/1.1"])
    return context


class GrpcFront:
    """The gRPC gateway's raw methods on octacloud's HTTP/2 server (``protocols/grpc/h2.py``, no ``grpc.aio``)
    with the gateway's bounds: message size on the length prefix, the key on the metadata, calls in progress,
    streams per connection, connections, preface/handshake and idle time; what calls hold before their message
    completes, per connection and per tenant, and the message's time (``body_timeout_s``); output not taken for
    ``body_timeout_s`` closes the connection; TLS with ALPN h2."""

    def __init__(self, gateway: GrpcGateway, limits: GatewayLimits, tls: TlsConfig | None = None) -> None:
        self.gateway = gateway
        self.limits = limits
        self.tls = tls
        self.server = Http2Server(
            gateway.methods(),
            admit=gateway.admit,
            gate=gateway.gate,
            release=gateway.release,
            max_message_bytes=limits.max_message_bytes,
            max_streams=MAX_STREAMS,
            max_calls=limits.max_concurrent_rpcs,
            max_connections=connection_cap(limits),
            header_timeout_s=limits.header_timeout_s,
            idle_timeout_s=limits.keep_alive_s * 60,
            max_header_bytes=limits.max_header_bytes,
            limits=Http2Limits(
                buffered_bytes_per_connection=limits.grpc_unfinished_bytes_per_connection,
                buffered_bytes_per_owner=limits.grpc_unfinished_bytes_per_tenant,
                streams_per_owner=limits.grpc_unfinished_calls_per_tenant,
                message_timeout_s=limits.body_timeout_s,
                stall_timeout_s=limits.body_timeout_s,
            ),
            owner=gateway.owner,
        )

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        return await self.server.start(host, port, ssl=grpc_ssl_context(self.tls), reuse_port=reuse_port)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await self.gateway.close()


def grpc_ssl_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """The gRPC front's TLS context for the cloud's certificate (ALPN h2; client certificates when the cloud
    requires them), or None for plain text."""
    if tls is None:
        return None
    client_ca = str(tls.client_ca) if tls.client_ca is not None else None
    return server_ssl_context(str(tls.certfile), str(tls.keyfile), client_ca)


@dataclass(slots=True)
class Fronts:
    """A process's public fronts (REST and gRPC) and the ports they got."""

    rest: Front
    grpc: Front
    http_port: int = 0
    grpc_port: int = 0

    async def start(self, host: str, http_port: int, grpc_port: int, reuse_port: bool = False) -> None:
        """gRPC first, then REST (REST serves the admin API and readiness: it comes up once all can serve)."""
        self.grpc_port = await self.grpc.start(host, grpc_port, reuse_port)
        try:
            self.http_port = await self.rest.start(host, http_port, reuse_port)
        except BaseException:
            await self.grpc.stop(0)
            raise

    async def stop(self, grace: float = 1.0) -> None:
        await self.rest.stop(grace)
        await self.grpc.stop(grace)


def gateway_fronts(rest: ASGIApp, grpc_gateway: GrpcGateway, limits: GatewayLimits, tls: TlsConfig | None) -> Fronts:
    """The fronts every gateway process serves: the REST app and the gRPC gateway, with the same bounds and TLS."""
    return Fronts(RestFront(rest, limits, tls), GrpcFront(grpc_gateway, limits, tls))
