"""The replica's side of the per-cloud internal secret: only its cloud's gateway (and controller) may call it.

A replica that a cloud launches gets the path of a file holding the cloud's secret in
``OCTACLOUD_INTERNAL_SECRET_FILE``; every request must then carry that secret in ``x-octacloud-internal``
(an HTTP header on REST and metrics, gRPC metadata on gRPC), compared in constant time. Without it: REST and
metrics answer 401, gRPC UNAUTHENTICATED. The health endpoints (``/v2/health/live|ready``, ``ServerLive``,
``ServerReady``) stay open: they say only whether the process is up.

``octacloud serve`` started by hand (no secret configured) is open, as Triton is: bind it to loopback, or put
it behind something that authenticates.

Internal TLS (:class:`ReplicaTls`): a replica given a certificate, its key and its cloud's CA
(``OCTACLOUD_INTERNAL_TLS_CERT``, ``..._KEY``, ``..._CA``, or explicitly) serves REST, gRPC and metrics over
TLS only and requires a client certificate signed by that CA (mutual TLS): a handshake from anything but its
own cloud fails before a byte of HTTP is read. The secret is still checked inside.
"""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from octacloud.core.errors import InvalidSpecError

ENV_VAR = "OCTACLOUD_INTERNAL_SECRET_FILE"
HEADER = "x-octacloud-internal"
TENANT_HEADER = "x-octacloud-tenant"
"""The calling tenant, as the gateway verified it: believed only by a replica that requires the secret (a client
reaching an open replica could claim any tenant); requests of a model whose rows are coupled share batches only
with the same tenant's (serving/model.py)."""
_TENANT_HEADER = TENANT_HEADER.encode()
_HEADER = HEADER.encode()
REFUSED = f"this replica serves its cloud's gateway only: {HEADER} is missing or wrong"
OPEN_HTTP_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
OPEN_GRPC_METHODS = frozenset(
    {"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady"}
)


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


def matches(secret: bytes, presented: bytes | str | None) -> bool:
    if presented is None:
        return False
    value = presented.encode("latin-1", errors="replace") if isinstance(presented, str) else presented
    return hmac.compare_digest(value, secret)


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class RequireSecret:
    """ASGI middleware: HTTP requests without the secret get 401 before the app (or the body) is read."""

    def __init__(self, app: ASGIApp, secret: bytes) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_HTTP_PATHS:
            presented = next((v for k, v in scope["headers"] if k == _HEADER), None)
            if not matches(self.secret, presented):
                body = b'{"error":"' + REFUSED.encode() + b'"}'
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class SecretInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """gRPC: calls without the secret in their metadata are aborted with UNAUTHENTICATED before they run."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_GRPC_METHODS:
            return handler
        presented = next((v for k, v in details.invocation_metadata or () if k == HEADER), None)
        if matches(self.secret, presented):
            return handler
        return _refusing(handler)


def _refusing(handler: Any) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
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


def wsgi_requiring_secret(app: WSGIApp, secret: bytes) -> WSGIApp:
    """The metrics endpoint (WSGI): 401 without the secret."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not matches(secret, environ.get("HTTP_X_OCTACLOUD_INTERNAL")):
            body = REFUSED.encode()
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start_response)

    return guarded


def tenant_of(pairs: Iterable[tuple[Any, Any]]) -> str:
    """The gateway's ``x-octacloud-tenant`` among HTTP headers (bytes) or gRPC metadata (str); "" if absent."""
    for k, v in pairs:
        if k in (TENANT_HEADER, _TENANT_HEADER):
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return ""
