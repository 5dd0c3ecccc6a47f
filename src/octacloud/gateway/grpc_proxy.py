"""The gateway's gRPC front end: forwards KServe V2 / Triton gRPC calls to replicas as raw bytes.

Messages are not decoded except for the model name (field 1 of every per-model request), read as protobuf
reads it (the last occurrence wins); the rest passes through untouched. Server-level calls (live, ready,
metadata) are answered by the gateway itself with Triton's generated messages.

With a :class:`Guard`, every call but ServerLive and ServerReady needs ``authorization: Bearer <key>``
metadata (UNAUTHENTICATED otherwise); a deployment the caller may not see is NOT_FOUND like an unknown one; a
tenant over its request rate gets RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata. The key is
checked on the call's metadata before its message is read (:meth:`GrpcGateway.admit`, the HTTP/2 server's
admission hook), and a message over ``GatewayLimits.max_message_bytes`` is refused from its length prefix.

Both hops run on the event loop without ``grpc.aio`` (whose poller thread wakes the loop several times per
call, measured in bench/results/cloud.md): the front is :class:`~octacloud.protocols.grpc.h2.Http2Server` with raw
methods (``gateway.fronts.GrpcFront``), and each replica is reached over HTTP/2 by
:class:`~octacloud.protocols.grpc.h2_client.Channel`, so the replica serves the call exactly as a direct
one. A replica's own status, details and trailing metadata are passed on as they are.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from octacloud import __version__
from octacloud.gateway.forward import Exhausted, Forwarding, TimedOut, Unanswered
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import SERVER_EXTENSIONS
from octacloud.gateway.routing import DeploymentCounters, Endpoint, NotAdmitted, RouteTable
from octacloud.gateway.stats import merge_model_statistics
from octacloud.protocols import headers
from octacloud.protocols.endpoints import ENDPOINTS, GRPC_SERVICE, OPEN_GRPC_METHODS
from octacloud.protocols.grpc.h2 import CallContext, Metadata, Method, Refusal, metadata_block
from octacloud.protocols.grpc.h2_client import Answer, Channel, Unreachable
from octacloud.security.internal_auth import HEADER, REPLICA_HEADER, TENANT_HEADER
from octacloud.tenancy import ANONYMOUS_ADMIN, AuthError, Guard, Principal, RateLimitedError

SERVICE = GRPC_SERVICE
PER_MODEL = tuple(e.grpc for e in ENDPOINTS if e.grpc and e.per_model and e.gateway in ("forward", "fan_out"))
"""The per-model calls the gateway forwards (the endpoint table's, ``protocols/endpoints.py``)."""
_FAN_OUT = frozenset(e.grpc for e in ENDPOINTS if e.grpc and e.gateway == "fan_out")
"""Asked of every ready replica and answered with the sum (statistics)."""
_OPEN = OPEN_GRPC_METHODS
MAX_STREAMS = 256
"""Concurrent calls per client connection."""
_RETRY_SOON = (("retry-after", "1"),)
PUBLIC_MESSAGE_BYTES = 4096
"""The largest message of a call the gateway answers itself (their requests are empty or a name)."""


@dataclass(slots=True)
class Admitted:
    """A per-model call the gateway let through: its caller, deployment and slot under the in-flight bound."""

    principal: Principal
    deployment: str
    counters: DeploymentCounters
    released: bool = False


def model_name(message: bytes) -> str:
    """Field 1 (a string) of a protobuf message as protobuf reads it: the last occurrence wins ('' if absent).
    Raises ValueError for a message that is not well-formed protobuf (truncated, bad wire type, not UTF-8)."""
    pos = 0
    end = len(message)
    name = b""
    while pos < end:
        key, pos = _varint(message, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == 2:
            length, pos = _varint(message, pos)
            if pos + length > end:
                raise ValueError("truncated length-delimited field")
            if field == 1:
                name = message[pos : pos + length]
            pos += length
        elif field == 1:
            raise ValueError("field 1 (the model name) is not a string")
        elif wire == 0:
            _, pos = _varint(message, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
    return name.decode("utf-8")  # UnicodeDecodeError is a ValueError: proto3 strings are UTF-8


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class GrpcGateway:
    """Per-model calls proxied to the right deployment's replicas; server-level calls answered here."""

    def __init__(
        self,
        routes: RouteTable,
        ready: Callable[[], bool] = lambda: True,
        timeout: float | None = None,
        guard: Guard | None = None,
        limits: GatewayLimits | None = None,
        internal_secret: str | None = None,
        replica_ssl: ssl.SSLContext | None = None,
    ) -> None:
        if replica_ssl is not None:  # gRPC needs HTTP/2 agreed by ALPN; HTTP/1.1 stays on offer for REST's pool
            replica_ssl.set_alpn_protocols(["h2", "http/1.1"])
        self.core = Forwarding(routes, guard, limits or GatewayLimits(), ready)
        """The forwarding mechanism (``gateway/forward.py``); this front translates gRPC to it and back."""
        self.guard = guard
        self.routes = routes
        self.ready = ready
        self.limits = self.core.limits
        self.timeout = self.limits.upstream_timeout_s if timeout is None else timeout
        """Seconds to wait for a replica's answer (``GatewayLimits.upstream_timeout_s`` unless given)."""
        self.replica_ssl = replica_ssl
        """Internal TLS to the replicas' gRPC ports (a client context of the cloud CA's, for this hop alone: ALPN
        ``h2``, ``http/1.1`` is set on it); None: plain text (replicas on loopback)."""
        self._internal = ((HEADER, internal_secret),) if internal_secret else ()
        self._channels: dict[tuple[str, int], Channel] = {}
        self._draining: dict[tuple[str, int], Channel] = {}
        """Channels to replicas dropped from the routes, finishing their calls in flight."""
        self._named: dict[str, bytes] = {}
        """Each replica's ``x-octacloud-replica`` field, encoded once."""
        self._per_model = frozenset(f"/{SERVICE}/{name}" for name in PER_MODEL)
        routes.on_drop.append(self._forget)
        routes.on_gone.append(self._gone)

    def methods(self) -> dict[str, Method]:
        """Every method the gateway serves, by HTTP/2 path: raw (the message stays bytes)."""
        out = {f"/{SERVICE}/{name}": Method(None, self._forwarder(name), streaming=False) for name in PER_MODEL}
        out.update(self._public())
        return out

    def _public(self) -> dict[str, Method]:
        """Server-level calls the gateway answers itself; a message that is not protobuf is INVALID_ARGUMENT."""
        metadata = service_pb2.ServerMetadataResponse(
            name="octacloud", version=__version__, extensions=SERVER_EXTENSIONS
        ).SerializeToString()
        live = service_pb2.ServerLiveResponse(live=True).SerializeToString()
        answers: dict[str, tuple[Any, Callable[[], bytes]]] = {
            "ServerLive": (service_pb2.ServerLiveRequest, lambda: live),
            "ServerReady": (
                service_pb2.ServerReadyRequest,
                lambda: service_pb2.ServerReadyResponse(ready=self.ready()).SerializeToString(),
            ),
            "ServerMetadata": (service_pb2.ServerMetadataRequest, lambda: metadata),
        }

        def method(kind: Any, answer: Callable[[], bytes]) -> Method:
            async def call(request: bytes, context: CallContext) -> bytes:
                try:
                    kind.FromString(request)
                except DecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")
                return answer()

            return Method(None, call, streaming=False, max_message_bytes=PUBLIC_MESSAGE_BYTES)

        return {f"/{SERVICE}/{name}": method(kind, answer) for name, (kind, answer) in answers.items()}

    def owner(self, state: Any) -> str | None:
        """Whose budget a call's input is held on at the front (``h2_limits``): its tenant's; for a caller without
        a key (the open calls, or every call without a guard) None, which the server reads as the call's
        connection: an anonymous client cannot use up a budget that other callers without a key would share."""
        return state.tenant if isinstance(state, Principal) and state.key_id else None

    def admit(self, path: str, metadata: Metadata) -> Principal | Refusal:
        """The caller, or why its call is refused (code, details, trailing metadata): on metadata alone,
        before the message is read. ServerLive and ServerReady are open."""
        if path in _OPEN:
            return ANONYMOUS_ADMIN
        try:
            return self.core.authorize(metadata)
        except AuthError as exc:
            return grpc.StatusCode.UNAUTHENTICATED, str(exc), ()
        except RateLimitedError as exc:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after", str(exc.retry_after)),)

    def admission(self, principal: Principal, request: bytes) -> Admitted | Refusal:
        """Whether a per-model call goes on, decided at once from its message's model name: a refusal
        (malformed message, cloud starting, unknown or invisible deployment, no replica, the deployment's
        in-flight bound reached: UNAVAILABLE with ``retry-after: 1``), or its slot under that bound, taken."""
        try:
            deployment = model_name(request)
        except ValueError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}", ()
        counters = self.core.admit(deployment, principal)
        if isinstance(counters, NotAdmitted):
            if counters.why == "unknown":
                return grpc.StatusCode.NOT_FOUND, counters.message, ()
            return grpc.StatusCode.UNAVAILABLE, counters.message, _RETRY_SOON if counters.why == "at capacity" else ()
        counters.outstanding += 1
        return Admitted(principal, deployment, counters)

    def gate(self, path: str, state: Any, message: bytes) -> Any:
        """The HTTP/2 server's gate (``h2.Gate``): a per-model call is admitted or refused in the frame
        handling, before a task exists, so that a refusal over the in-flight bound costs one trailers-only
        HEADERS frame and nothing queues in front of the bound; other calls pass as they are."""
        if path not in self._per_model:
            return state
        return self.admission(state, message)

    def release(self, state: Any) -> None:
        """The slot an admitted call held, freed once: by the forwarder as it ends, or by the HTTP/2 server once
        the call's task is done (the forwarder never ran: cancelled before it started)."""
        if type(state) is Admitted and not state.released:
            state.released = True
            state.counters.outstanding -= 1

    def _channel(self, endpoint: Endpoint) -> Channel:
        key = (endpoint.host, endpoint.grpc_port)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = Channel(endpoint.host, endpoint.grpc_port, ssl_context=self.replica_ssl)
        return channel

    def _naming(self, endpoint: Endpoint) -> bytes:
        """The metadata field that names the replica a call is meant for (a replica that is not it refuses)."""
        block = self._named.get(endpoint.replica_id)
        if block is None:
            block = self._named[endpoint.replica_id] = metadata_block([(REPLICA_HEADER, endpoint.replica_id)])
        return block

    def _forget(self, endpoint: Endpoint) -> None:
        """A replica the route table dropped: no new call goes to it, and its connections close once the calls in
        flight there are answered (a replica stopped on purpose drains them)."""
        self._named.pop(endpoint.replica_id, None)
        for key in [k for k, c in self._draining.items() if not c.open_connections]:
            del self._draining[key]
        key = (endpoint.host, endpoint.grpc_port)
        channel = self._channels.pop(key, None)
        if channel is not None:
            channel.drain()
            if channel.open_connections:
                self._draining[key] = channel

    def _gone(self, endpoint: Endpoint) -> None:
        """A replica found dead: its calls in flight end now (and are retried on another replica)."""
        key = (endpoint.host, endpoint.grpc_port)
        channel = self._draining.pop(key, None) or self._channels.pop(key, None)
        if channel is not None:
            channel.close()

    def _forwarder(self, method: str) -> Callable[[bytes, CallContext], Any]:
        path = f"/{SERVICE}/{method}"
        internal = metadata_block(self._internal)
        blocks: dict[tuple[Metadata, str], bytes] = {}

        def forwarded(received: Metadata, tenant: str) -> bytes:
            """The metadata a replica gets: the client's less its credentials and the internal names, with the
            cloud's own (the internal secret; the tenant, for per-tenant batches: ``protocols/internal.py``)."""
            metadata = blocks.get((received, tenant))
            if metadata is None:  # a client's calls repeat their metadata: the forwarded block is encoded once
                kept = headers.forwarded(received)
                kept.append((TENANT_HEADER, tenant))
                metadata = metadata_block(kept) + internal
                if len(blocks) >= 1024:
                    blocks.clear()
                blocks[(received, tenant)] = metadata
            return metadata

        async def forward(request: bytes, context: CallContext) -> bytes:
            held = context.state
            if not isinstance(held, Admitted):  # not gated by the front (see gate): decided here
                verdict = self.admission(held, request)
                if type(verdict) is tuple:
                    code, details, trailing = verdict
                    await context.abort(code, details, trailing)
                held = cast(Admitted, verdict)
            metadata = forwarded(context.invocation_metadata(), held.principal.tenant)
            started = time.perf_counter()
            try:
                if method in _FAN_OUT:
                    return await self._statistics(held, path, request, metadata, context)
                return await self._exchange(held, path, request, metadata, context)
            finally:
                self.release(held)  # at once, not a loop turn later in the server's release (a no-op then)
                held.counters.latency_us_total += int((time.perf_counter() - started) * 1e6)

        return forward

    async def _exchange(
        self, held: Admitted, path: str, request: bytes, metadata: bytes, context: CallContext
    ) -> bytes:
        """A replica's answer to the call, counted and billed; its refusal passed on as it came (a load shed one,
        with ``retry-after``, not billed: REST bills no 5xx)."""
        deployment, counters = held.deployment, held.counters

        async def ask(endpoint: Endpoint) -> Answer:
            try:
                named = metadata + self._naming(endpoint)
                answer = await self._channel(endpoint).call(path, named, request, self.timeout)
            except Unreachable as exc:
                raise Unanswered(str(exc)) from None
            if answer.code is grpc.StatusCode.UNAVAILABLE and _retry_after(answer) is None:
                raise Unanswered(answer.details)  # no answer of the replica's own: it is not serving
            return answer

        try:
            answer, _ = await self.core.forward(deployment, counters, len(request), ask, self.timeout)
        except Exhausted as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), (("retry-after", str(exc.retry_after)),))
        except TimedOut as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        usage = self.routes.tenant_traffic(held.principal.tenant, deployment)
        if answer.code is not grpc.StatusCode.OK:  # the replica answered with an error of the request's, or shed it
            shed = _retry_after(answer) is not None
            self.core.settle(counters, usage, len(request), 0, failed=True, billed=not shed)
            await context.abort(answer.code, answer.details, answer.trailing)
        if answer.trailing:
            context.set_trailing_metadata(answer.trailing)
        self.core.settle(counters, usage, len(request), len(answer.message), failed=False, billed=True)
        return answer.message

    async def _statistics(
        self, held: Admitted, path: str, request: bytes, metadata: bytes, context: CallContext
    ) -> bytes:
        """Ask every ready replica of the deployment and answer with the sum (see ``gateway.stats``)."""
        deployment, counters = held.deployment, held.counters

        async def ask(endpoint: Endpoint) -> Answer | None:
            try:
                named = metadata + self._naming(endpoint)
                answer = await self._channel(endpoint).call(path, named, request, self.timeout)
            except (Unreachable, TimeoutError):
                return None
            return None if answer.code is grpc.StatusCode.UNAVAILABLE else answer

        answers = await self.core.fan_out(deployment, counters, len(request), ask)
        for a in answers:
            if a.code is not grpc.StatusCode.OK:  # e.g. an unknown version: every replica says the same
                await context.abort(a.code, a.details)
        if not answers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"deployment '{deployment}' has no ready replica")
        dicts = [
            json_format.MessageToDict(
                service_pb2.ModelStatisticsResponse.FromString(a.message), preserving_proto_field_name=True
            )
            for a in answers
        ]
        merged = json_format.ParseDict(merge_model_statistics(dicts), service_pb2.ModelStatisticsResponse())
        message = bytes(merged.SerializeToString())
        usage = self.routes.tenant_traffic(held.principal.tenant, deployment)
        self.core.settle(counters, usage, len(request), len(message), failed=False, billed=True)
        return message

    async def close(self) -> None:
        for channel in (*self._channels.values(), *self._draining.values()):
            channel.close()
        self._channels.clear()
        self._draining.clear()


def _retry_after(answer: Answer) -> str | None:
    """The ``retry-after`` a replica put in its answer's trailing metadata (a refusal it chose to make, not a
    failure to answer), or None."""
    for key, value in answer.trailing:
        if key == "retry-after":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None
