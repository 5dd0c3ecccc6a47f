"""The replica's side of the per-cloud internal secret: only its cloud's gateway (and controller) may call it.

A replica that a cloud launches gets the path of a file holding the cloud's secret in
``OCTACLOUD_INTERNAL_SECRET_FILE``; every request must then carry that secret in ``x-octacloud-internal``
(an HTTP header on REST and metrics, gRPC metadata on gRPC), compared in constant time. Without it: REST and
metrics answer 401, gRPC UNAUTHENTICATED. The health endpoints (``/v2/health/live|ready``, ``ServerLive``,
``ServerReady``: the open rows of ``protocols/endpoints.py``) stay open: they say only whether the process is up.

A replica launched by a cloud also knows its own id (``OCTACLOUD_REPLICA_ID``). The gateway and the prober name
the replica they mean in ``x-octacloud-replica``; a replica that is not the one named answers REST and metrics
``421 Misdirected Request``, gRPC ``UNAVAILABLE``, and the caller tries another replica. A replica's port is
picked when it starts and freed when it dies, so another replica started later (of another deployment, another
tenant) can get the same port: without the check, a route or a probe still holding the dead replica's address
would reach the new process and take its answer as the dead replica's. A request that names no replica (a
direct caller holding the secret) is served.

``octacloud serve`` started by hand (no secret configured) is open, as Triton is: bind it to loopback, or put
it behind something that authenticates.

Internal TLS (:class:`ReplicaTls`): a replica given a certificate, its key and its cloud's CA
(``OCTACLOUD_INTERNAL_TLS_CERT``, ``..._KEY``, ``..._CA``, or explicitly) serves REST, gRPC and metrics over
TLS only and requires a client certificate signed by that CA (mutual TLS): a handshake from anything but its
own cloud fails before a byte of HTTP is read. The secret is still checked inside.
"""

from __future__ import annotations

import hmac
import json
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from octacloud.core.errors import InvalidSpecError
from octacloud.protocols.endpoints import OPEN_GRPC_METHODS as OPEN_GRPC_METHODS
from octacloud.protocols.endpoints import OPEN_HTTP_PATHS as OPEN_HTTP_PATHS

ENV_VAR = "OCTACLOUD_INTERNAL_SECRET_FILE"
HEADER = "x-octacloud-internal"
TENANT_HEADER = "x-octacloud-tenant"
"""The calling tenant, as the gateway verified it: believed only by a replica that requires the secret (a client
reaching an open replica could claim any tenant); requests of a model whose rows are coupled share batches only
with the same tenant's (serving/model.py)."""
_TENANT_HEADER = TENANT_HEADER.encode()
_HEADER = HEADER.encode()
REPLICA_HEADER = "x-octacloud-replica"
"""The replica a request is meant for (its id): a replica that is someone else answers 421 / UNAVAILABLE."""
REPLICA_HEADER_BYTES = REPLICA_HEADER.encode()
REPLICA_ID_ENV = "OCTACLOUD_REPLICA_ID"
REFUSED = f"this replica serves its cloud's gateway only: {HEADER} is missing or wrong"


TLS_CERT_ENV = "OCTACLOUD_INTERNAL_TLS_CERT"
TLS_KEY_ENV = "OCTACLOUD_INTERNAL_TLS_KEY"
TLS_CA_ENV = "OCTACLOUD_INTERNAL_TLS_CA"
HANDSHAKE_TIMEOUT_S = 10.0
"""A client that opens a connection and does not finish the TLS handshake in this long is dropped."""


@dataclass(frozen=True, slots=True)
class ReplicaTls:
    """A replica's internal TLS files: its certificate, its key (mode 0600) and the CA its clients must hold."""

    certfile: Path
    keyfile: Path
    client_ca: Path

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a replica process."""
        return {TLS_CERT_ENV: str(self.certfile), TLS_KEY_ENV: str(self.keyfile), TLS_CA_ENV: str(self.client_ca)}

    def server_context(self, alpn: Sequence[str] = ()) -> ssl.SSLContext:
        """A server context: our certificate, client certificates required and checked against the CA."""
        try:
            mode = self.keyfile.stat().st_mode
            if mode & 0o077:
                raise InvalidSpecError(
                    f"internal TLS key {self.keyfile} is readable by others (mode {mode & 0o777:o}); chmod 600 it"
                )
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.client_ca)
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidSpecError(f"internal TLS files {self.certfile}, {self.keyfile}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if alpn:
            context.set_alpn_protocols(list(alpn))
        return context

    def version(self) -> tuple[int, int]:
        """What changes when the certificate file is replaced (inode, modification time)."""
        stat = self.certfile.stat()
        return stat.st_ino, stat.st_mtime_ns

    def reload(self, contexts: Sequence[ssl.SSLContext]) -> None:
        """Load the files' certificate and key into running ``contexts`` (their next handshakes use them).
        A pair that does not load together is refused first, and the contexts keep what they had."""
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.certfile, self.keyfile)
        for context in contexts:
            context.load_cert_chain(self.certfile, self.keyfile)


def tls_from_env() -> ReplicaTls | None:
    """The internal TLS files a launcher gave this process (None: plain text)."""
    values = [os.environ.get(name) for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
    if not any(values):
        return None
    if not all(values):
        raise InvalidSpecError(f"internal TLS needs all of {TLS_CERT_ENV}, {TLS_KEY_ENV} and {TLS_CA_ENV}")
    return ReplicaTls(*(Path(v) for v in values if v))


def read_secret(path: Path | str) -> bytes:
    """The secret in ``path``; refuses a file others may read, or one too short to be a secret."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise InvalidSpecError(f"internal secret {path}: {e.strerror}") from None
    if mode & 0o077:
        raise InvalidSpecError(f"internal secret {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    if len(text) < 32:
        raise InvalidSpecError(f"internal secret {path} is shorter than 32 characters")
    return text.encode()


def secret_file_from_env() -> Path | None:
    name = os.environ.get(ENV_VAR)
    return Path(name) if name else None


def replica_id_from_env() -> str:
    """The id the launcher gave this replica ("" when started by hand)."""
    return os.environ.get(REPLICA_ID_ENV, "")


def misdirected(own: str, pairs: Iterable[tuple[Any, Any]]) -> str | None:
    """Why a request is not this replica's (it names another replica in ``x-octacloud-replica``), else None.
    ``pairs``: HTTP headers (bytes) or gRPC metadata (str); ``own`` "" checks nothing."""
    if not own:
        return None
    for k, v in pairs:
        if k in (REPLICA_HEADER, REPLICA_HEADER_BYTES):
            named = v.decode("latin-1") if isinstance(v, bytes) else str(v)
            if named == own:
                return None
            return f"this is replica {own!r}, not {named[:128]!r}: the address the caller holds is out of date"
    return None


def matches(secret: bytes, presented: bytes | str | None) -> bool:
    if presented is None:
        return False
    value = presented.encode("latin-1", errors="replace") if isinstance(presented, str) else presented
    return hmac.compare_digest(value, secret)


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class RequireSecret:
    """ASGI middleware: HTTP requests without the secret get 401 before the app (or the body) is read; a request
    meant for another replica (``replica_id`` set) gets 421."""

    def __init__(self, app: ASGIApp, secret: bytes, replica_id: str = "") -> None:
        self.app = app
        self.secret = secret
        self.replica_id = replica_id

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = http_refusal(self.secret, self.replica_id, scope["path"], scope["headers"])
            if refused is not None:
                await _refuse(send, *refused)
                return
        await self.app(scope, receive, send)


def http_refusal(
    secret: bytes, replica_id: str, path: str, headers: Iterable[tuple[bytes, bytes]]
) -> tuple[int, str] | None:
    """Why a replica refuses an HTTP request on its headers alone (status, message): 401 without the secret (but
    on the open health paths), 421 when it names another replica; None when it is served."""
    if path not in OPEN_HTTP_PATHS:
        presented = next((v for k, v in headers if k == _HEADER), None)
        if not matches(secret, presented):
            return 401, REFUSED
    wrong = misdirected(replica_id, headers)
    return None if wrong is None else (421, wrong)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class SecretInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """gRPC: calls without the secret in their metadata are aborted with UNAUTHENTICATED before they run; calls
    meant for another replica (``replica_id`` set) with UNAVAILABLE."""

    def __init__(self, secret: bytes, replica_id: str = "") -> None:
        self.secret = secret
        self.replica_id = replica_id

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        metadata = details.invocation_metadata or ()
        if details.method not in OPEN_GRPC_METHODS:
            presented = next((v for k, v in metadata if k == HEADER), None)
            if not matches(self.secret, presented):
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSED)
        wrong = misdirected(self.replica_id, metadata)
        if wrong is not None:
            return _refusing(handler, grpc.StatusCode.UNAVAILABLE, wrong)
        return handler


def _refusing(handler: Any, code: grpc.StatusCode, details: str) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await context.abort(code, details)

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(code, details)
        yield None  # pragma: no cover - abort raises

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, streaming),
        (True, False): (grpc.stream_unary_rpc_method_handler, unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, streaming),
    }
    make, behaviour = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, handler.request_deserializer, handler.response_serializer)


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def wsgi_requiring_secret(app: WSGIApp, secret: bytes, replica_id: str = "") -> WSGIApp:
    """The metrics endpoint (WSGI): 401 without the secret, 421 when meant for another replica (a scraper
    holding a dead replica's address must not count another replica's figures as its)."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        status, message = "", ""
        if not matches(secret, environ.get("HTTP_X_OCTACLOUD_INTERNAL")):
            status, message = "401 Unauthorized", REFUSED
        else:
            named = environ.get("HTTP_X_OCTACLOUD_REPLICA")
            wrong = misdirected(replica_id, [(REPLICA_HEADER, named)]) if named is not None else None
            if wrong is not None:
                status, message = "421 Misdirected Request", wrong
        if status:
            body = message.encode()
            start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start_response)

    return guarded


def tenant_of(pairs: Iterable[tuple[Any, Any]]) -> str:
    """The gateway's ``x-octacloud-tenant`` among HTTP headers (bytes) or gRPC metadata (str); "" if absent."""
    for k, v in pairs:
        if k in (TENANT_HEADER, _TENANT_HEADER):
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return ""
