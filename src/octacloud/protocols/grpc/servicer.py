"""The Open Inference Protocol over gRPC: Triton's ``GRPCInferenceService`` (generated modules shipped in
``tritonclient.grpc``) on ``grpc.aio``, translating to and from the DataPlane.

Its methods are the gRPC methods of the endpoint table (``protocols/endpoints.py``), each over the row's DataPlane
operation. Errors abort the call with the code :mod:`octacloud.serving.errors` gives them (one decorator,
:func:`answers_errors`, on every method), or UNIMPLEMENTED (shared memory, tracing and logging are not offered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from octacloud.protocols.endpoints import GRPC_SERVICE
from octacloud.protocols.errorlog import BoundedErrorLog
from octacloud.protocols.internal import tenant_of
from octacloud.protocols.tensors import from_list, from_raw, to_raw
from octacloud.serving import (
    DataPlane,
    InferenceRequest,
    InferenceResponse,
    InvalidInputError,
    RequestedOutput,
    Tensor,
    status_of,
)
from octacloud.serving.stats import Duration
from octacloud.serving.types import numpy_dtype, scheduling_parameters

log = logging.getLogger(__name__)
_errors = BoundedErrorLog(log)
Context: TypeAlias = Any  # grpc.aio.ServicerContext (grpc ships no type hints)

_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def code_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC code of ``error``, read from the one table in :mod:`octacloud.serving.errors`."""
    code: grpc.StatusCode = grpc.StatusCode[status_of(error).grpc]
    return code


_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])
SERVICE = GRPC_SERVICE


class Malformed:
    """What a request that does not parse as its protobuf message becomes: the handler answers
    INVALID_ARGUMENT (grpc itself would answer UNKNOWN and log a traceback per request)."""

    id = ""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"the request is not a valid {kind} message: {error}"


def _lenient(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Malformed(message.DESCRIPTOR.name, e)

    return parse


def answers_errors(method: _Handler) -> _Handler:
    """Abort the call with the error's code (:func:`code_of`) and message; log only unexpected errors."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: Context) -> Any:
        try:
            if isinstance(request, Malformed):
                raise InvalidInputError(request.message)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            answer = status_of(e)
            if not answer.expected:
                _errors.exception(method.__name__, e)
            retry = (("retry-after", str(answer.retry_after_s)),) if answer.retry_after_s else ()
            await context.abort(grpc.StatusCode[answer.grpc], str(e), trailing_metadata=retry)

    return handler  # type: ignore[return-value]


def _param(p: pb.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def decode_infer(r: pb.ModelInferRequest | Malformed) -> InferenceRequest:
    if isinstance(r, Malformed):
        raise InvalidInputError(r.message)
    raw = r.raw_input_contents
    if raw and len(raw) != len(r.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {len(r.inputs)} inputs; give one per input"
        )
    inputs = []
    for i, t in enumerate(r.inputs):
        shape = tuple(t.shape)
        if raw:
            data = from_raw(t.name, t.datatype, shape, raw[i])
        else:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                numpy_dtype(t.datatype)  # unknown datatype: a clear error
                raise InvalidInputError(f"input {t.name!r}: {t.datatype} must be sent in raw_input_contents")
            values = list(getattr(t.contents, field))
            data = from_list(t.name, t.datatype, shape, values)
        inputs.append(Tensor(t.name, t.datatype, shape, data))
    params = {k: _param(v) for k, v in r.parameters.items()}
    outputs = [RequestedOutput(o.name, {k: _param(v) for k, v in o.parameters.items()}) for o in r.outputs]
    return InferenceRequest(
        r.model_name,
        inputs,
        r.model_version,
        r.id,
        outputs,
        params,
        *scheduling_parameters(params),
    )


def encode_infer(response: InferenceResponse) -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name=response.model, model_version=response.version, id=response.id)
    for t in response.outputs:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        out.raw_output_contents.append(to_raw(t.data))
    return out


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Triton's gRPC service over one :class:`DataPlane`."""

    def __init__(self, dataplane: DataPlane, *, trust_tenant: bool = False) -> None:
        self.dataplane = dataplane
        self.trust_tenant = trust_tenant
        """Read the gateway's tenant metadata (only behind the internal secret, protocols/internal.py)."""

    def _decode(self, request: pb.ModelInferRequest, context: Context) -> InferenceRequest:
        decoded = decode_infer(request)
        if self.trust_tenant:
            decoded = dataclasses.replace(decoded, tenant=tenant_of(context.invocation_metadata() or ()))
        return decoded

    @answers_errors
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    @answers_errors
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.server_ready())

    @answers_errors
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.dataplane.model_ready(request.name, request.version))

    @answers_errors
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        m = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=m.name, version=m.version, extensions=m.extensions)

    @answers_errors
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        m = self.dataplane.model_metadata(request.name, request.version)

        def io(ts: Iterable[Any]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [
                pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape) for t in ts
            ]

        return pb.ModelMetadataResponse(
            name=m.name, versions=m.versions, platform=m.platform, inputs=io(m.inputs), outputs=io(m.outputs)
        )

    @answers_errors
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self.dataplane.model_config(request.name, request.version))

    @answers_errors
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        stats = self.dataplane.model_statistics(request.name, request.version)
        out = pb.ModelStatisticsResponse()
        for v in stats:
            s = v.stats
            m = out.model_stats.add(
                name=v.name,
                version=v.version,
                last_inference=s.last_inference_ms,
                inference_count=s.inference_count,
                execution_count=s.execution_count,
            )
            i = m.inference_stats
            for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
                getattr(i, field).CopyFrom(_duration(getattr(s, field)))
            for size, b in sorted(s.batch_stats.items()):
                m.batch_stats.add(
                    batch_size=size,
                    compute_input=_duration(b.compute_input),
                    compute_infer=_duration(b.compute_infer),
                    compute_output=_duration(b.compute_output),
                )
        return out

    @answers_errors
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        response = await self.dataplane.infer(self._decode(request, context))
        return encode_infer(response)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests of one stream run concurrently (so they can share a batch); each response goes out when
        ready, carrying its request's id, as Triton's decoupled streaming does."""
        done: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                response = await self.dataplane.infer(self._decode(request, context))
                done.put_nowait(pb.ModelStreamInferResponse(infer_response=encode_infer(response)))
            except Exception as e:
                if not status_of(e).expected:
                    _errors.exception("ModelStreamInfer", e)
                done.put_nowait(
                    pb.ModelStreamInferResponse(
                        error_message=str(e), infer_response=pb.ModelInferResponse(id=request.id)
                    )
                )

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.ensure_future(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
            done.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await done.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    @answers_errors
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        out = pb.RepositoryIndexResponse()
        for e in self.dataplane.repository_index(request.ready):
            out.models.add(name=e.name, version=e.version, state=e.state, reason=e.reason)
        return out

    @answers_errors
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        await self.dataplane.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @answers_errors
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await self.dataplane.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


def add_to_server(dataplane: DataPlane, server: grpc.aio.Server, *, trust_tenant: bool = False) -> None:
    """Register Triton's service, every method parsing its request leniently (see :class:`Malformed`)."""
    servicer = InferenceServicer(dataplane, trust_tenant=trust_tenant)
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        kind = grpc.stream_stream_rpc_method_handler if method.client_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


__all__ = ["InferenceServicer", "add_to_server", "answers_errors", "code_of", "decode_infer", "encode_infer"]
