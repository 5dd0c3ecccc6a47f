"""The gateway's gRPC front end: forwards KServe V2 / Triton gRPC calls to replicas as raw bytes.

Messages are not decoded except for the model name (field 1 of every per-model request), read as protobuf
reads it (the last occurrence wins); the rest passes through untouched. Server-level calls (live, ready,
metadata) are answered by the gateway itself with Triton's generated messages.

With a :class:`Guard`, every call but ServerLive and ServerReady needs ``authorization: Bearer <key>``
metadata (UNAUTHENTICATED otherwise); a deployment the caller may not see is NOT_FOUND like an unknown one; a
tenant over its request rate gets RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata. The key is
checked on the call's metadata before its message is read (:meth:`GrpcGateway.handler` picks, per call, a
handler that never reads the message when the key is wrong), and gRPC itself refuses a message over
``GatewayLimits.max_message_bytes`` from its length prefix (see :func:`server_options`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from octacloud import __version__
from octacloud.cluster.auth import ANONYMOUS_ADMIN, AuthError, Guard, Principal, RateLimitedError
from octacloud.cluster.gateway.limits import GatewayLimits
from octacloud.cluster.gateway.rest import MAX_ATTEMPTS, SERVER_EXTENSIONS
from octacloud.cluster.gateway.routing import Endpoint, RouteTable, TenantTraffic
from octacloud.cluster.gateway.stats import merge_model_statistics
from octacloud.cluster.internal_auth import HEADER, TENANT_HEADER

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
PER_MODEL = ("ModelReady", "ModelMetadata", "ModelInfer", "ModelConfig", "ModelStatistics")
PUBLIC = ("ServerLive", "ServerReady")
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE,)
_DROPPED_METADATA = {"authorization", HEADER, TENANT_HEADER}


def server_options(limits: GatewayLimits) -> list[tuple[str, int]]:
    """The gateway's gRPC server options: message sizes bounded (checked on the length prefix), idle
    connections closed, keep-alive pings from clients rate-limited."""
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_connection_idle_ms", int(limits.keep_alive_s * 1000) * 60),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.max_concurrent_streams", 256),
        ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
    ]


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


class _Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Chooses each call's handler from its method and metadata, before its message is read."""

    def __init__(self, gateway: GrpcGateway) -> None:
        self.gateway = gateway
        self.public = gateway.public_handlers()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        prefix, _, name = method.rpartition("/")
        if prefix != f"/{SERVICE}":
            return None
        if name in PUBLIC:
            return self.public[name]
        if name not in PER_MODEL and name != "ServerMetadata":
            return None
        metadata: Sequence[tuple[str, Any]] = handler_call_details.invocation_metadata or ()  # type: ignore[attr-defined]
        refused = self.gateway.refusal(metadata)
        if isinstance(refused, tuple):
            return grpc.stream_unary_rpc_method_handler(_refuse(*refused))  # stream: the message is never read
        if name == "ServerMetadata":
            return self.public[name]
        return grpc.unary_unary_rpc_method_handler(self.gateway.forwarder(name, refused, metadata))


def _refuse(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...]
) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        if trailing:
            context.set_trailing_metadata(trailing)
        await context.abort(code, details)

    return refuse


class GrpcGateway:
    """A generic gRPC handler that proxies per-model calls to the right deployment's replicas."""

    def __init__(
        self,
        routes: RouteTable,
        ready: Callable[[], bool] = lambda: True,
        timeout: float = 60.0,
        guard: Guard | None = None,
        limits: GatewayLimits | None = None,
        internal_secret: str | None = None,
        internal_tls: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.internal_tls = internal_tls
        """Internal TLS: replica channels are secure, the replica's certificate checked against the cloud CA."""
        self.guard = guard
        self.routes = routes
        self.ready = ready
        self.timeout = timeout
        self.limits = limits or GatewayLimits()
        self._internal = ((HEADER, internal_secret),) if internal_secret else ()
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()
        routes.on_drop.append(self._forget)

    def handler(self) -> grpc.GenericRpcHandler:
        return _Handler(self)

    def public_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Server-level calls the gateway answers itself; a message that is not protobuf is INVALID_ARGUMENT."""
        answers: dict[str, tuple[Any, Callable[[], Any]]] = {
            "ServerLive": (service_pb2.ServerLiveRequest, lambda: service_pb2.ServerLiveResponse(live=True)),
            "ServerReady": (
                service_pb2.ServerReadyRequest,
                lambda: service_pb2.ServerReadyResponse(ready=self.ready()),
            ),
            "ServerMetadata": (
                service_pb2.ServerMetadataRequest,
                lambda: service_pb2.ServerMetadataResponse(
                    name="octacloud", version=__version__, extensions=SERVER_EXTENSIONS
                ),
            ),
        }

        def handler(kind: Any, answer: Callable[[], Any]) -> grpc.RpcMethodHandler:
            async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    kind.FromString(request)
                except DecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")
                return bytes(answer().SerializeToString())

            return grpc.unary_unary_rpc_method_handler(call)

        return {name: handler(kind, answer) for name, (kind, answer) in answers.items()}

    def refusal(
        self, metadata: Sequence[tuple[str, Any]]
    ) -> Principal | tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
        """The caller, or why its call is refused (code, details, trailing metadata): on metadata alone."""
        if self.guard is None:
            return ANONYMOUS_ADMIN
        try:
            principal = self.guard.authorize(tuple(metadata))
            self.guard.admit(principal)
        except AuthError as exc:
            return grpc.StatusCode.UNAUTHENTICATED, str(exc), ()
        except RateLimitedError as exc:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after", str(exc.retry_after)),)
        return principal

    def _channel(self, endpoint: Endpoint) -> grpc.aio.Channel:
        key = (endpoint.host, endpoint.grpc_port)
        channel = self._channels.get(key)
        if channel is None:
            options = [
                ("grpc.max_send_message_length", self.limits.max_message_bytes),
                ("grpc.max_receive_message_length", -1),
            ]
            target = f"{key[0]}:{key[1]}"
            channel = self._channels[key] = (
                grpc.aio.insecure_channel(target, options=options)
                if self.internal_tls is None
                else grpc.aio.secure_channel(target, self.internal_tls, options=options)
            )
        return channel

    def _forget(self, endpoint: Endpoint) -> None:
        """Close the channel to a replica the route table dropped (called on the gateway's loop)."""
        channel = self._channels.pop((endpoint.host, endpoint.grpc_port), None)
        if channel is not None and _loop_running():
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def forwarder(
        self, method: str, principal: Principal, metadata: Sequence[tuple[str, Any]]
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        path = f"/{SERVICE}/{method}"
        forwarded = tuple((k, v) for k, v in metadata if k not in _DROPPED_METADATA) + self._internal
        forwarded += ((TENANT_HEADER, principal.tenant),)  # per-tenant batches (protocols/internal.py)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                deployment = model_name(request)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")
            if not self.ready():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the cloud is starting; retry shortly")
            owner = self.routes.owners.get(deployment)
            visible = (
                (owner is not None or deployment in self.routes.routes)
                if self.guard is None
                else (owner is not None and principal.may_see(owner.tenant, owner.published))
            )
            if not visible:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model or deployment '{deployment}'")
            endpoints = self.routes.routes.get(deployment, [])
            if not endpoints:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"deployment '{deployment}' has no ready replica yet")
            counters = self.routes.counter(deployment)
            bound = self.routes.inflight_bound(deployment, self.limits.max_inflight_per_replica)
            if bound and counters.outstanding >= bound:
                counters.shed += 1
                context.set_trailing_metadata((("retry-after", "1"),))
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"deployment '{deployment}' is at capacity ({bound} requests in flight)",
                )
            usage = self.routes.tenant_traffic(principal.tenant, deployment)
            started = time.perf_counter()
            counters.requests += 1
            counters.bytes_in += len(request)
            counters.outstanding += 1
            tried: list[str] = []
            why = f"deployment '{deployment}' has no ready replica"
            try:
                if method == "ModelStatistics":
                    merged = await self._statistics(deployment, path, request, forwarded, context)
                    counters.bytes_out += len(merged)
                    _bill(usage, len(request), len(merged))
                    return merged
                for _ in range(MAX_ATTEMPTS):
                    endpoint = self.routes.choose(deployment, tried)
                    if endpoint is None:
                        break
                    tried.append(endpoint.replica_id)
                    call = self._channel(endpoint).unary_unary(path)
                    endpoint.outstanding += 1
                    try:
                        response: bytes = await call(request, timeout=self.timeout, metadata=forwarded)
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code()
                        shed = _retry_after(exc)  # the replica answered: it sheds load or is loading the model
                        if code in _UNAVAILABLE and shed is None:
                            self.routes.failed(endpoint)
                            log.warning("deployment %s: replica %s: %s", deployment, endpoint.replica_id, exc.details())
                            why = f"deployment '{deployment}': {len(tried)} replica(s) tried, none answered"
                            continue
                        counters.failures += 1
                        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                            self.routes.failed(endpoint)
                            await context.abort(code, f"deployment '{deployment}': no answer within {self.timeout:g} s")
                        self.routes.succeeded(endpoint)
                        if shed is not None:  # passed on as it came, not billed (as REST bills no 5xx)
                            await context.abort(code, exc.details() or "", (("retry-after", shed),))
                        _bill(usage, len(request), 0)  # the replica answered (with an error of the request's)
                        await context.abort(code, exc.details() or "")
                    finally:
                        endpoint.outstanding -= 1
                    self.routes.succeeded(endpoint)
                    counters.bytes_out += len(response)
                    _bill(usage, len(request), len(response))
                    return response
                counters.failures += 1
                context.set_trailing_metadata((("retry-after", str(self.routes.retry_after(deployment))),))
                await context.abort(grpc.StatusCode.UNAVAILABLE, why)
            finally:
                counters.outstanding -= 1
                counters.latency_us_total += int((time.perf_counter() - started) * 1e6)
            raise AssertionError("unreachable")  # context.abort always raises

        return forward

    async def _statistics(
        self,
        deployment: str,
        path: str,
        request: bytes,
        metadata: tuple[tuple[str, Any], ...],
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        """Ask every ready replica of ``deployment`` and answer with the sum (see ``gateway.stats``)."""

        async def ask(endpoint: Endpoint) -> bytes | grpc.aio.AioRpcError | None:
            try:
                answer: bytes = await self._channel(endpoint).unary_unary(path)(
                    request, timeout=self.timeout, metadata=metadata
                )
                return answer
            except grpc.aio.AioRpcError as exc:
                return None if exc.code() in _UNAVAILABLE else exc

        answers = [a for a in await asyncio.gather(*(ask(e) for e in self.routes.healthy(deployment))) if a is not None]
        for a in answers:
            if isinstance(a, grpc.aio.AioRpcError):  # e.g. an unknown version: every replica says the same
                await context.abort(a.code(), a.details() or "")
        if not answers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"deployment '{deployment}' has no ready replica")
        dicts = [
            json_format.MessageToDict(
                service_pb2.ModelStatisticsResponse.FromString(a), preserving_proto_field_name=True
            )
            for a in answers
            if isinstance(a, bytes)
        ]
        merged = json_format.ParseDict(merge_model_statistics(dicts), service_pb2.ModelStatisticsResponse())
        return bytes(merged.SerializeToString())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _retry_after(exc: grpc.aio.AioRpcError) -> str | None:
    """The ``retry-after`` a replica put in its answer's trailing metadata (a refusal it chose to make, not a
    failure to answer), or None."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _bill(usage: TenantTraffic, bytes_in: int, bytes_out: int) -> None:
    usage.requests += 1
    usage.bytes_in += bytes_in
    usage.bytes_out += bytes_out
