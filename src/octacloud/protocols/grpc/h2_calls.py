"""What a call on octacloud's HTTP/2 server (``h2.py``) is given and may do: its context, its method, the hooks
that admit or refuse it, and the admission and TLS of a cloud's replica."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from tritonclient.grpc import service_pb2 as pb

from octacloud.protocols.grpc.servicer import InferenceServicer, _lenient
from octacloud.protocols.internal import HEADER as SECRET_HEADER
from octacloud.protocols.internal import OPEN_GRPC_METHODS, REFUSED, matches, misdirected


class Abort(grpc.aio.AbortError):  # type: ignore[misc]  # the servicer's decorator lets an AbortError through
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing


class CallContext:
    """The part of ``grpc.aio.ServicerContext`` a servicer uses: ``abort``, ``invocation_metadata``, ``peer``,
    ``set_code``/``set_details``, ``set_trailing_metadata``."""

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...], peer: str, state: Any = None) -> None:
        self._metadata = metadata
        self._peer = peer
        self.state = state
        """What the server's ``admit`` hook returned for this call (e.g. the caller's principal)."""
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: Any = ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise Abort(code, details, trailing_metadata or self.trailing)

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@dataclass(frozen=True, slots=True)
class Method:
    parse: Callable[[bytes], Any] | None
    """The request message's decoder; None: a raw method, called with the message's bytes, answering bytes."""
    call: Callable[..., Any]
    streaming: bool
    max_message_bytes: int | None = None
    """Its request message's limit, when smaller than the server's (e.g. calls anyone may make, whose messages
    are empty): more is refused from the length prefix."""


Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]
Refusal: TypeAlias = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]
"""Why a call is refused: its status, details and trailing metadata."""
Admit: TypeAlias = Callable[[str, Metadata], Any]
"""``admit(path, metadata)``, before the message is read: a :data:`Refusal` tuple ends the call; anything else
is the call's ``context.state``."""
Gate: TypeAlias = Callable[[str, Any, bytes], Any]
"""``gate(path, state, message)``, once a unary call's whole message has arrived, in the frame handling itself
(no task yet): a :data:`Refusal` tuple ends the call with a trailers-only answer queued in this loop turn's
write, the method never called; anything else becomes the call's ``context.state``."""


def methods(servicer: InferenceServicer) -> dict[str, Method]:
    """Every method of the service, by HTTP/2 path."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    out = {}
    for m in service.methods:
        request_type = getattr(pb, m.input_type.name)
        streaming = m.client_streaming or m.server_streaming
        out[f"/{service.full_name}/{m.name}"] = Method(_lenient(request_type), getattr(servicer, m.name), streaming)
    return out


def require_secret(secret: bytes, replica_id: str = "") -> Admit:
    """The admission of a replica of a cloud: calls without the secret are UNAUTHENTICATED (but ServerLive and
    ServerReady), calls meant for another replica than ``replica_id`` UNAVAILABLE."""
    refused: Refusal = (grpc.StatusCode.UNAUTHENTICATED, REFUSED, ())

    def admit(path: str, metadata: Metadata) -> Refusal | None:
        if path not in OPEN_GRPC_METHODS:
            presented = next((v for k, v in metadata if k == SECRET_HEADER), None)
            if not matches(secret, presented):
                return refused
        wrong = misdirected(replica_id, metadata)
        return None if wrong is None else (grpc.StatusCode.UNAVAILABLE, wrong, ())

    return admit


def server_ssl_context(certfile: str, keyfile: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A TLS server context for gRPC: ALPN ``h2``, TLS 1.2 or later, client certificates required when
    ``client_ca`` is given."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


__all__ = [
    "Abort",
    "Admit",
    "CallContext",
    "Gate",
    "Metadata",
    "Method",
    "Refusal",
    "methods",
    "require_secret",
    "server_ssl_context",
]
