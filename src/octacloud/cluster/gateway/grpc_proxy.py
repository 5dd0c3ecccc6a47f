"""The gateway's gRPC front end: forwards KServe V2 / Triton gRPC calls to replicas as raw bytes.

Messages are not decoded except for the model name (field 1 of every per-model request), which is read from
the first bytes of the message; the rest passes through untouched. Server-level calls (live, ready,
metadata) are answered by the gateway itself with Triton's generated messages.

With a :class:`Guard`, every call but ServerLive and ServerReady needs ``authorization: Bearer <key>``
metadata (UNAUTHENTICATED otherwise); a deployment the caller may not see is NOT_FOUND like an unknown one; a
tenant over its request rate gets RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from octacloud import __version__
from octacloud.cluster.auth import ANONYMOUS_ADMIN, AuthError, Guard, Principal, RateLimitedError
from octacloud.cluster.gateway.rest import MAX_ATTEMPTS, SERVER_EXTENSIONS
from octacloud.cluster.gateway.routing import Endpoint, RouteTable
from octacloud.cluster.gateway.stats import merge_model_statistics

SERVICE = "inference.GRPCInferenceService"
PER_MODEL = ("ModelReady", "ModelMetadata", "ModelInfer", "ModelConfig", "ModelStatistics")
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE,)


def model_name(message: bytes) -> str:
    """Field 1 (a string) of a protobuf message, read without decoding the rest ('' if absent)."""
    pos = 0
    end = len(message)
    while pos < end:
        key, pos = _varint(message, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(message, pos)
            if field == 1:
                return message[pos : pos + length].decode("utf-8", "replace")
            pos += length
        elif wire == 0:
            _, pos = _varint(message, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            return ""
    return ""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class GrpcGateway:
    """A generic gRPC handler that proxies per-model calls to the right deployment's replicas."""

    def __init__(
        self,
        routes: RouteTable,
        ready: Callable[[], bool] = lambda: True,
        timeout: float = 60.0,
        guard: Guard | None = None,
    ) -> None:
        self.guard = guard
        self.routes = routes
        self.ready = ready
        self.timeout = timeout
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler] = {}
        for name in PER_MODEL:
            methods[name] = grpc.unary_unary_rpc_method_handler(self._forwarder(name))
        methods["ServerLive"] = grpc.unary_unary_rpc_method_handler(
            self._server_live,
            request_deserializer=service_pb2.ServerLiveRequest.FromString,
            response_serializer=service_pb2.ServerLiveResponse.SerializeToString,
        )
        methods["ServerReady"] = grpc.unary_unary_rpc_method_handler(
            self._server_ready,
            request_deserializer=service_pb2.ServerReadyRequest.FromString,
            response_serializer=service_pb2.ServerReadyResponse.SerializeToString,
        )
        methods["ServerMetadata"] = grpc.unary_unary_rpc_method_handler(
            self._server_metadata,
            request_deserializer=service_pb2.ServerMetadataRequest.FromString,
            response_serializer=service_pb2.ServerMetadataResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def _server_live(self, _req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def _server_ready(self, _req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.ready())

    async def _authorize(self, context: grpc.aio.ServicerContext) -> Principal:
        """The caller; aborts the call with UNAUTHENTICATED or RESOURCE_EXHAUSTED otherwise."""
        if self.guard is None:
            return ANONYMOUS_ADMIN
        try:
            principal = self.guard.authorize(tuple(context.invocation_metadata() or ()))
            self.guard.admit(principal)
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except RateLimitedError as exc:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return principal

    async def _server_metadata(self, _req: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        return service_pb2.ServerMetadataResponse(name="octacloud", version=__version__, extensions=SERVER_EXTENSIONS)

    def _channel(self, endpoint: Endpoint) -> grpc.aio.Channel:
        key = (endpoint.host, endpoint.grpc_port)
        channel = self._channels.get(key)
        if channel is None:
            options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            channel = self._channels[key] = grpc.aio.insecure_channel(f"{key[0]}:{key[1]}", options=options)
        return channel

    def _forwarder(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        path = f"/{SERVICE}/{method}"

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                deployment = model_name(request)
            except ValueError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed request message")
            principal = await self._authorize(context)
            owner = self.routes.owners.get(deployment)
            if deployment not in self.routes.routes or (
                self.guard is not None and (owner is None or not principal.may_see(owner.tenant, owner.published))
            ):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model or deployment '{deployment}'")
            counters = self.routes.counter(deployment)
            usage = self.routes.tenant_traffic(principal.tenant, deployment)
            started = time.perf_counter()
            counters.requests += 1
            counters.bytes_in += len(request)
            counters.outstanding += 1
            usage.requests += 1
            usage.bytes_in += len(request)
            tried: list[str] = []
            last = f"deployment '{deployment}' has no ready replica"
            try:
                if method == "ModelStatistics":
                    merged = await self._statistics(deployment, path, request, context)
                    counters.bytes_out += len(merged)
                    usage.bytes_out += len(merged)
                    return merged
                for _ in range(MAX_ATTEMPTS):
                    endpoint = self.routes.choose(deployment, tried)
                    if endpoint is None:
                        break
                    tried.append(endpoint.replica_id)
                    call = self._channel(endpoint).unary_unary(path)
                    endpoint.outstanding += 1
                    try:
                        metadata = tuple((k, v) for k, v in context.invocation_metadata() or () if k != "authorization")
                        response: bytes = await call(request, timeout=self.timeout, metadata=metadata)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in _UNAVAILABLE:
                            endpoint.failures += 1
                            last = f"replica {endpoint.replica_id} unavailable: {exc.details()}"
                            continue
                        counters.failures += 1
                        await context.abort(exc.code(), exc.details() or "")
                    finally:
                        endpoint.outstanding -= 1
                    endpoint.failures = 0
                    counters.bytes_out += len(response)
                    usage.bytes_out += len(response)
                    return response
                counters.failures += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, last)
            finally:
                counters.outstanding -= 1
                counters.latency_us_total += int((time.perf_counter() - started) * 1e6)
            raise AssertionError("unreachable")  # context.abort always raises

        return forward

    async def _statistics(self, deployment: str, path: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Ask every ready replica of ``deployment`` and answer with the sum (see ``gateway.stats``)."""
        metadata = tuple((k, v) for k, v in context.invocation_metadata() or () if k != "authorization")

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
