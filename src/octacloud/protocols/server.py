"""One replica server: REST (octacloud's HTTP/1.1 server), gRPC (octacloud's HTTP/2 server, or grpc.aio) and
Prometheus metrics over one DataPlane, in one process and one event loop. Binds 127.0.0.1 unless told otherwise;
port 0 picks a free port.

In-process (tests, the gateway's replicas)::

    server = ReplicaServer(ServerSettings(repository="models", http_port=0, grpc_port=0, metrics_port=0))
    await server.start()          # models loaded and warmed up; ports bound
    ... server.http_port, server.grpc_port, server.metrics_port ...
    await server.stop()

As a process: ``octacloud serve --repository DIR`` (see ``octacloud.cli.serve``).

Launched by a cloud, a replica has the cloud's internal secret (``OCTACLOUD_INTERNAL_SECRET_FILE``, see
:mod:`octacloud.protocols.internal`): REST, gRPC and metrics then answer only requests that carry it, and a
wildcard host (``0.0.0.0``, ``::``) binds loopback instead (its ports carry plain text; a replica that must be
reached from another node is given that node-internal address explicitly). Without a secret (``octacloud
serve`` by hand) the endpoints are open, as Triton's are, on the host given.

Given internal TLS files (``OCTACLOUD_INTERNAL_TLS_*``, see :class:`~octacloud.protocols.internal.ReplicaTls`),
every endpoint — REST (ALPN ``http/1.1``), gRPC (ALPN ``h2``) and metrics — serves TLS only and requires a
client certificate of the cloud's CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import make_asgi_app, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from octacloud import idlespin
from octacloud.observability.serving import serving_registry
from octacloud.protocols.grpc import add_to_server
from octacloud.protocols.grpc.h2 import GrpcServer
from octacloud.protocols.internal import (
    HANDSHAKE_TIMEOUT_S,
    ReplicaTls,
    RequireSecret,
    SecretInterceptor,
    read_secret,
    replica_id_from_env,
    secret_file_from_env,
    tls_from_env,
    wsgi_requiring_secret,
)
from octacloud.protocols.rest.app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, ReplicaHttp1, RestApp
from octacloud.protocols.rest.bridge import AsgiBridge
from octacloud.protocols.rest.server import Http1Server
from octacloud.serving import ControlMode, DataPlane, ModelRepository, RuntimeFactory, VersionStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerSettings:
    """How to start a replica. Ports: 0 picks a free one; ``None`` turns that endpoint off."""

    repository: Path | str
    host: str = "127.0.0.1"
    http_port: int | None = 8000
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    http_fd: int | None = None
    """A bound TCP socket this process inherited for REST (its launcher bound it: the port is the replica's from
    the moment the launcher picked it, so no other process can take it before this one listens); the
    ``http_port`` is then ignored. Likewise ``grpc_fd`` and ``metrics_fd``."""
    grpc_fd: int | None = None
    metrics_fd: int | None = None
    control_mode: ControlMode = ControlMode.NONE
    load_models: Sequence[str] = ()
    threads: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    poll_interval_s: float = 15.0
    grpc_grace_s: float = 5.0
    http_grace_s: float = 5.0
    """On stop: how long REST answers in progress may take before their connections are closed."""
    keep_alive_s: float = 30.0
    """An idle keep-alive REST connection is closed after this."""
    header_timeout_s: float = 10.0
    """A REST request's line and headers must arrive within this of the connection's start or last answer."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """An inference request's body must arrive within this once its head has (408 and close after it)."""
    grpc_server: str = "h2"
    """``h2``: octacloud's HTTP/2 server on the event loop (:mod:`octacloud.protocols.grpc.h2`); ``aio``:
    ``grpc.aio``."""
    runtimes: Mapping[str, RuntimeFactory] | None = field(default=None)
    internal_secret_file: Path | None = field(default_factory=secret_file_from_env)
    """The cloud's internal secret (default: ``$OCTACLOUD_INTERNAL_SECRET_FILE``); None: open endpoints."""
    replica_id: str = field(default_factory=replica_id_from_env)
    """This replica's id in its cloud (default: ``$OCTACLOUD_REPLICA_ID``): behind the secret, a request that names
    another replica in ``x-octacloud-replica`` is refused (421 / UNAVAILABLE); "" checks nothing."""
    tls: ReplicaTls | None = field(default_factory=tls_from_env)
    """Internal TLS (default: ``$OCTACLOUD_INTERNAL_TLS_CERT|KEY|CA``); None: plain text."""
    fetch_seconds: float | None = None
    """How long fetching the model from the model store into the node cache took before this start (exported
    with the load and warm-up as the replica's cold start); None: the repository was local."""
    tls_reload_s: float = 30.0
    """How often the certificate file is checked; a renewed one serves the next handshakes (no restart; REST,
    metrics and the ``h2`` gRPC server — ``grpc.aio`` keeps the certificate it started with)."""
    metrics_on_loop: bool = False
    """Serve metrics on the event loop (octacloud's HTTP/1.1 server, the same secret checks) instead of a thread of
    their own: what a process that hosts many replicas needs (one idle thread per replica would each wake up twice
    a second)."""

    def __post_init__(self) -> None:
        if self.internal_secret_file is not None and self.tls is None and self.host in WILDCARD_HOSTS:
            log.warning(
                "a replica of a cloud serves plain text: binding 127.0.0.1, not %s (name a node-internal address "
                "to be reached from other nodes)",
                self.host or "every interface",
            )
            self.host = "127.0.0.1"


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "[::]"})
MAX_HEADER_BYTES = 2**20
"""A REST request's line and headers together (431 and close beyond)."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _metrics_server(app: Any, sock: socket.socket, tls: ssl.SSLContext | None = None) -> tuple[Any, threading.Thread]:
    """The metrics endpoint on ``sock`` (bound, not listening yet), in a thread of its own."""

    class Server(ThreadingWSGIServer):  # type: ignore[misc]
        address_family = sock.family

        def server_bind(self) -> None:
            # The socket is bound already: what HTTPServer.server_bind does after the bind, and the WSGI
            # environment WSGIServer.server_bind sets up.
            self.socket.close()
            self.socket = sock
            address = sock.getsockname()
            self.server_address = address
            self.server_name = str(address[0])
            self.server_port = int(address[1])
            self.setup_environ()

        def finish_request(self, request: Any, client_address: Any) -> None:
            if tls is None:
                super().finish_request(request, client_address)
                return
            request.settimeout(HANDSHAKE_TIMEOUT_S)  # the handshake runs in the request's own thread: a silent
            try:  # client blocks no one
                wrapped = tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                request.close()
                return
            try:
                super().finish_request(wrapped, client_address)
            finally:
                wrapped.close()  # the server closes the plain socket, which the wrapper took over

    sock.setblocking(True)  # the server's threads accept and read with blocking calls
    host, port = sock.getsockname()[:2]
    httpd = make_server(str(host), int(port), app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="replica-metrics", daemon=True)
    thread.start()
    return httpd, thread


def _inherited(fd: int, what: str) -> socket.socket:
    """The bound TCP socket ``fd`` a launcher handed this process for ``what`` (REST, gRPC, metrics)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise OSError(f"the {what} socket (file descriptor {fd}) is not an open socket: {e.strerror}") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise OSError(f"the {what} socket (file descriptor {fd}) is not a TCP socket")
    if sock.getsockname()[1] == 0:
        sock.detach()
        raise OSError(f"the {what} socket (file descriptor {fd}) is not bound to a port")
    sock.setblocking(False)
    return sock


def _bind(host: str, port: int, what: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind the {what} port {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def _endpoint_socket(fd: int | None, host: str, port: int | None, what: str, name: str) -> socket.socket:
    """An endpoint's socket, bound and not yet listening: the one inherited at ``fd``, else ``host:port`` bound
    here (``what`` names the endpoint in errors about the descriptor, ``name`` in errors about the port)."""
    return _inherited(fd, what) if fd is not None else _bind(host, port or 0, name)


class ReplicaServer:
    """REST + gRPC + metrics for one model repository. ``start``/``stop`` run on the caller's event loop."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.repository = ModelRepository(
            settings.repository,
            control_mode=settings.control_mode,
            runtimes=settings.runtimes,
            threads=settings.threads,
            poll_interval_s=settings.poll_interval_s,
        )
        self.dataplane = DataPlane(self.repository)
        self.secret = read_secret(settings.internal_secret_file) if settings.internal_secret_file else None
        tls = settings.tls
        self._tls_http = tls.server_context(("http/1.1",)) if tls is not None else None
        self._tls_grpc = tls.server_context(("h2",)) if tls is not None else None
        self._tls_metrics = tls.server_context() if tls is not None else None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._http: Http1Server | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_h2: GrpcServer | None = None
        self._metrics: Any = None
        self._metrics_http: Http1Server | None = None
        self._metrics_thread: threading.Thread | None = None
        self._tls_watch: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the REST endpoint."""
        return f"{self.settings.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.settings.host}:{self.grpc_port}"

    async def start(self) -> None:
        s = self.settings
        await self.repository.start(s.load_models)
        try:
            if s.http_port is not None or s.http_fd is not None:
                sock = _endpoint_socket(s.http_fd, s.host, s.http_port, "REST", "HTTP")
                self.http_port = sock.getsockname()[1]
                rest = RestApp(self.dataplane, s.max_body_bytes, trust_tenant=self.secret is not None)
                http = Http1Server(
                    ReplicaHttp1(rest, self.secret, s.replica_id, s.body_timeout_s),
                    max_header_bytes=MAX_HEADER_BYTES,
                    max_body_bytes=s.max_body_bytes,
                    header_timeout_s=s.header_timeout_s,
                    keep_alive_s=s.keep_alive_s,
                )
                try:
                    await http.start(sock, ssl=self._tls_http)  # the loop listens on it (backlog 2048)
                except BaseException:
                    sock.close()
                    raise
                self._http = http
            if s.grpc_port is not None or s.grpc_fd is not None:
                await self._start_grpc()
            if s.metrics_port is not None or s.metrics_fd is not None:
                sock = _endpoint_socket(s.metrics_fd, s.host, s.metrics_port, "metrics", "metrics")
                if s.metrics_on_loop:
                    await self._start_metrics_on_loop(sock)
                else:
                    metrics: Any = make_wsgi_app(serving_registry(self._stats))
                    if self.secret is not None:
                        metrics = wsgi_requiring_secret(metrics, self.secret, s.replica_id)
                    self._metrics, self._metrics_thread = _metrics_server(metrics, sock, self._tls_metrics)
                    self.metrics_port = self._metrics.server_port
        except BaseException:
            await self.stop()
            raise
        if s.tls is not None:
            self._tls_watch = asyncio.get_running_loop().create_task(self._watch_tls(s.tls))
        self.dataplane.ready = True
        log.info(
            "octacloud serving %s: http %s, grpc %s, metrics %s",
            s.repository,
            self.http_port,
            self.grpc_port,
            self.metrics_port,
        )

    async def _start_metrics_on_loop(self, sock: socket.socket) -> None:
        s = self.settings
        app: Any = make_asgi_app(serving_registry(self._stats))
        if self.secret is not None:
            app = RequireSecret(app, self.secret, s.replica_id)
        server = Http1Server(
            AsgiBridge(app), max_header_bytes=MAX_HEADER_BYTES, header_timeout_s=s.header_timeout_s,
            keep_alive_s=s.keep_alive_s,
        )  # fmt: skip
        try:
            self.metrics_port = await server.start(sock, ssl=self._tls_metrics)
        except BaseException:
            sock.close()
            raise
        self._metrics_http = server

    async def _start_grpc(self) -> None:
        s = self.settings
        inherited = _inherited(s.grpc_fd, "gRPC") if s.grpc_fd is not None else None
        grpc_port = inherited.getsockname()[1] if inherited is not None else (s.grpc_port or 0)
        options = [
            ("grpc.max_receive_message_length", s.max_body_bytes),
            ("grpc.max_send_message_length", 2**31 - 1),
            ("grpc.so_reuseport", 0),
        ]
        if s.grpc_server == "h2":
            self._grpc_h2 = GrpcServer(
                self.dataplane, max_message_bytes=s.max_body_bytes, secret=self.secret, replica_id=s.replica_id
            )
            self.grpc_port = await self._grpc_h2.start(s.host, grpc_port, ssl=self._tls_grpc, sock=inherited)
            return
        if inherited is not None:  # grpc.aio binds by address only: free the inherited socket, bind its port
            inherited.close()
        if s.grpc_server != "aio":
            raise ValueError(f"grpc_server must be h2 or aio, got {s.grpc_server!r}")
        server = self._grpc = grpc.aio.server(
            interceptors=[SecretInterceptor(self.secret, s.replica_id)] if self.secret is not None else [],
            options=options,
        )
        add_to_server(self.dataplane, server, trust_tenant=self.secret is not None)
        try:
            address = f"{s.host}:{grpc_port}"
            if s.tls is not None:
                root = s.tls.client_ca.read_bytes()
                pair = [(s.tls.keyfile.read_bytes(), s.tls.certfile.read_bytes())]
                credentials = grpc.ssl_server_credentials(pair, root, require_client_auth=True)
                self.grpc_port = server.add_secure_port(address, credentials)
            else:
                self.grpc_port = server.add_insecure_port(address)
        except RuntimeError:  # grpc says only that it failed
            raise OSError(f"cannot bind the gRPC port {s.host}:{grpc_port} (in use?)") from None
        await server.start()

    async def _watch_tls(self, tls: ReplicaTls) -> None:
        """Load a renewed certificate (the launcher replaces the files) for the next handshakes."""
        contexts = [c for c in (self._tls_http, self._tls_grpc, self._tls_metrics) if c is not None]
        version = tls.version()
        while True:
            await asyncio.sleep(self.settings.tls_reload_s)
            try:
                now = tls.version()
                if now != version:
                    tls.reload(contexts)
                    version = now
                    log.info("internal TLS: loaded the renewed certificate %s", tls.certfile)
            except (OSError, ssl.SSLError) as exc:  # half-written or gone: the old one serves until next time
                log.warning("internal TLS: cannot load %s yet: %s", tls.certfile, exc)

    def _stats(self) -> Iterable[VersionStats]:
        fetch = self.settings.fetch_seconds
        for _ in range(3):  # the metrics thread reads while the loop may change the set of models
            try:
                found = self.dataplane.model_statistics()
            except RuntimeError:
                continue
            if fetch is None:
                return found
            return [dataclasses.replace(v, cold_start={"fetch": fetch, **v.cold_start}) for v in found]
        return []

    async def stop(self) -> None:
        """Stop taking requests, finish those in flight, unload every model."""
        self.dataplane.ready = False
        if self._tls_watch is not None:
            self._tls_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tls_watch
            self._tls_watch = None
        if self._grpc is not None:
            await self._grpc.stop(self.settings.grpc_grace_s)
            self._grpc = None
        if self._grpc_h2 is not None:
            await self._grpc_h2.stop(self.settings.grpc_grace_s)
            self._grpc_h2 = None
        if self._http is not None:
            await self._http.stop(self.settings.http_grace_s)
            self._http = None
        if self._metrics_http is not None:
            await self._metrics_http.stop(self.settings.http_grace_s)
            self._metrics_http = None
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            if self._metrics_thread is not None:
                self._metrics_thread.join(timeout=5)
            self._metrics = self._metrics_thread = None
        await self.repository.close()

    async def serve_until_signalled(self) -> None:
        """Start, serve until SIGINT or SIGTERM, then stop cleanly."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        try:
            await self.start()
            await stopping.wait()
        finally:
            await self.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def new_event_loop(spin_env: str = "") -> asyncio.AbstractEventLoop:
    """The event loop every octacloud server runs on: uvloop when available (uvicorn[standard] brings it),
    polling for the window the variable ``spin_env`` sets after it last did work, when it is set
    (:mod:`octacloud.idlespin`)."""
    window = idlespin.window_us_from_env(spin_env) if spin_env else 0
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    idlespin.install(loop, window)
    return loop


def run(settings: ServerSettings) -> None:
    """Run a replica in this process (uvloop when available) until SIGINT/SIGTERM."""
    # A serving process keeps a large, long-lived heap (models, grpc, numpy): move what exists at start out of
    # the collector's view and collect less often, so that full collections do not stretch the latency tail.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    with asyncio.Runner(loop_factory=lambda: new_event_loop(idlespin.REPLICA_SPIN_ENV)) as runner:
        runner.run(ReplicaServer(settings).serve_until_signalled())
