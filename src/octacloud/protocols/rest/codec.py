"""JSON (and Triton binary tensor data) for the REST front end."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from octacloud.protocols.tensors import from_list, from_raw, to_list, to_raw
from octacloud.serving import (
    InferenceRequest,
    InferenceResponse,
    InvalidInputError,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    ServerMetadata,
    Tensor,
    VersionStats,
)
from octacloud.serving.stats import Duration
from octacloud.serving.types import scheduling_parameters

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(body: bytes | memoryview, what: str = "request") -> Any:
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"the {what} body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidInputError(f"the {what} body nests JSON too deeply") from None


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{where} must be a string, got {_kind(value)}")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidInputError(f"{where} 'shape' must be a list of integers, got {_short(value)}")
    return tuple(value)


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} 'parameters' must be an object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class HeaderCache:
    """JSON headers of binary-tensor requests, parsed and checked once, and the JSON headers of their answers,
    encoded once: a client that sends the same header again (any client whose names, shapes and options do not
    change from call to call, as perf_analyzer's or a service's fixed-size calls) then costs a dict lookup instead
    of a JSON parse, its checks and a JSON encode. Only headers that carry no tensor data are kept (every input
    binary, every answer's output binary); a request's data, its total length and BYTES contents are still checked
    on every call. Keyed by the exact header bytes with the model and version of the path; at most
    ``max_entries`` of each, emptied when full (a client whose every header differs, a fresh ``id`` per call,
    costs a lookup and nothing more)."""

    __slots__ = ("max_entries", "requests", "responses")

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self.requests: dict[tuple[str, str, bytes], _RequestTemplate] = {}
        self.responses: dict[tuple[Any, ...], bytes] = {}

    def keep(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        """``value`` under ``key`` in ``table`` (``requests`` or ``responses``), emptied first when full."""
        if len(table) >= self.max_entries:
            table.clear()
        table[key] = value


MAX_CACHED_HEADER = 4096
"""Longer JSON headers are parsed every time (and not kept)."""


@dataclass(frozen=True, slots=True)
class _RequestTemplate:
    """A parsed request header whose inputs are all binary: what :func:`decode_infer` would build, less the data."""

    inputs: tuple[tuple[str, str, tuple[int, ...], Mapping[str, Any], int], ...]
    """(name, datatype, shape, parameters, binary_data_size) of each input."""
    size: int
    """The binary data the header describes, in bytes."""
    id: str
    outputs: tuple[RequestedOutput, ...]
    parameters: Mapping[str, Any]
    priority: int
    timeout_us: int

    @staticmethod
    def of(request: InferenceRequest) -> _RequestTemplate | None:
        inputs = []
        for t in request.inputs:
            size = t.parameters.get("binary_data_size")
            if size is None:  # the data is in the header: nothing to reuse
                return None
            inputs.append((t.name, t.datatype, t.shape, dict(t.parameters), size))
        return _RequestTemplate(  # copies: the request it is made from goes on to its caller
            tuple(inputs),
            sum(x[4] for x in inputs),
            request.id,
            tuple(RequestedOutput(o.name, dict(o.parameters)) for o in request.outputs),
            dict(request.parameters),
            request.priority,
            request.timeout_us,
        )

    def request(self, binary: memoryview, model: str, version: str) -> InferenceRequest:
        tensors = []
        offset = 0
        for name, datatype, shape, params, size in self.inputs:
            data = from_raw(name, datatype, shape, binary[offset : offset + size])
            tensors.append(Tensor(name, datatype, shape, data, dict(params)))
            offset += size
        outputs = [RequestedOutput(o.name, dict(o.parameters)) for o in self.outputs]
        return InferenceRequest(
            model, tensors, version, self.id, outputs, dict(self.parameters), self.priority, self.timeout_us
        )


def decode_infer(
    body: bytes, header_length: int | None, model: str, version: str, cache: HeaderCache | None = None
) -> InferenceRequest:
    """An :class:`InferenceRequest` from a JSON body, or a JSON header followed by binary tensor data.

    Every field is checked for its JSON type (names and datatypes strings, shapes lists of integers, parameters
    objects, outputs a list of objects), so that a malformed request is an :class:`InvalidInputError`. With a
    ``cache``, a header seen before is not parsed again (:class:`HeaderCache`)."""
    if cache is None or header_length is None or not 0 <= header_length <= min(len(body), MAX_CACHED_HEADER):
        return _decode_infer(body, header_length, model, version)
    key = (model, version, bytes(memoryview(body)[:header_length]))
    template = cache.requests.get(key)
    if template is not None and template.size == len(body) - header_length:
        return template.request(memoryview(body)[header_length:], model, version)
    request = _decode_infer(body, header_length, model, version)  # raises what is wrong with it
    if template is None:
        template = _RequestTemplate.of(request)
        if template is not None:
            cache.keep(cache.requests, key, template)
    return request


def _decode_infer(body: bytes, header_length: int | None, model: str, version: str) -> InferenceRequest:
    view = memoryview(body)
    if header_length is None:
        header = loads(view)
        binary = view[len(view) :]
    else:
        if header_length > len(view) or header_length < 0:
            raise InvalidInputError(
                f"Inference-Header-Content-Length is {header_length} but the body has only {len(view)} bytes"
            )
        header = loads(view[:header_length])
        binary = view[header_length:]
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InvalidInputError("the request must be a JSON object with an 'inputs' list")
    offset = 0
    inputs = []
    for i, entry in enumerate(header["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(entry, dict):
            raise InvalidInputError(f"{where} must be an object")
        for key in ("name", "datatype", "shape"):
            if key not in entry:
                raise InvalidInputError(f"{where} needs 'name', 'datatype' and an integer 'shape' (no {key!r})")
        name = _text(entry["name"], f"{where} 'name'")
        datatype = _text(entry["datatype"], f"input {name!r}: 'datatype'")
        shape = _shape(entry["shape"], f"input {name!r}:")
        params = _parameters(entry.get("parameters"), f"input {name!r}:")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInputError(f"input {name!r}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidInputError(
                    f"input {name!r}: binary data is truncated: needs {size} bytes at offset {offset}, "
                    f"but only {len(binary) - offset} follow the JSON header"
                )
            data = from_raw(name, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in entry:
            data = from_list(name, datatype, shape, entry["data"])
        else:
            raise InvalidInputError(f"input {name!r} has neither 'data' nor binary_data_size")
        inputs.append(Tensor(name, datatype, shape, data, params))
    if offset != len(binary):
        raise InvalidInputError(
            f"{len(binary) - offset} bytes of binary data follow the inputs that binary_data_size describes"
        )
    wanted = header.get("outputs")
    if wanted is None:
        wanted = []
    if not isinstance(wanted, list):
        raise InvalidInputError(f"'outputs' must be a list of objects, got {_kind(wanted)}")
    outputs = []
    for i, o in enumerate(wanted):
        if not isinstance(o, dict) or "name" not in o:
            raise InvalidInputError(f"outputs[{i}] must be an object with a 'name'")
        out = _text(o["name"], f"outputs[{i}] 'name'")
        outputs.append(RequestedOutput(out, _parameters(o.get("parameters"), f"output {out!r}:")))
    params = _parameters(header.get("parameters"), "the request's")
    request_id = header.get("id", "")
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        raise InvalidInputError(f"'id' must be a string, got {_kind(request_id)}")
    return InferenceRequest(
        model,
        inputs,
        version,
        str(request_id),
        outputs,
        params,
        *scheduling_parameters(params),
    )


def encode_infer(
    response: InferenceResponse, request: InferenceRequest, cache: HeaderCache | None = None
) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the length of its JSON header. With a ``cache``, an
    answer whose outputs are all binary reuses the header of an earlier answer of the same names, datatypes,
    shapes and sizes (:class:`HeaderCache`)."""
    binary_all = bool(request.parameters.get("binary_data_output", False))
    binary_of = {o.name: bool(o.parameters.get("binary_data", binary_all)) for o in request.outputs}
    raws: list[bytes] | None = None
    key: tuple[Any, ...] | None = None
    if cache is not None and response.outputs and all(binary_of.get(t.name, binary_all) for t in response.outputs):
        raws = [to_raw(t.data) for t in response.outputs]
        key = (
            response.model,
            response.version,
            response.id,
            *((t.name, t.datatype, tuple(t.shape), len(raw)) for t, raw in zip(response.outputs, raws, strict=True)),
        )
        cached = cache.responses.get(key)
        if cached is not None:
            return b"".join([cached, *raws]), len(cached)
    chunks: list[bytes] = []
    outputs = []
    for i, t in enumerate(response.outputs):
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary_of.get(t.name, binary_all):
            raw = to_raw(t.data) if raws is None else raws[i]
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = to_list(t.data)
        outputs.append(entry)
    head: dict[str, Any] = {"model_name": response.model, "model_version": response.version}
    if response.id:
        head["id"] = response.id
    head["outputs"] = outputs
    header = dumps(head)
    if cache is not None and key is not None:  # every output binary: the header carries no data
        cache.keep(cache.responses, key, header)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def server_metadata(m: ServerMetadata) -> dict[str, Any]:
    return {"name": m.name, "version": m.version, "extensions": list(m.extensions)}


def model_metadata(m: ModelMetadata) -> dict[str, Any]:
    def io(ts: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

    return {
        "name": m.name,
        "versions": list(m.versions),
        "platform": m.platform,
        "inputs": io(m.inputs),
        "outputs": io(m.outputs),
    }


def message_to_json(msg: Message) -> dict[str, Any]:
    """A protobuf message as Triton prints model configs: proto field names, scalar defaults included,
    64-bit integers as numbers (not strings), enums by name, maps as objects."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vf = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): (message_to_json(v) if vf.message_type else v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_scalar(field, v) for v in value]
        elif field.message_type is not None:
            if msg.HasField(field.name):
                out[field.name] = message_to_json(value)
        elif field.containing_oneof is not None and not msg.HasField(field.name):
            continue
        else:
            out[field.name] = _scalar(field, value)
    return out


def _scalar(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return message_to_json(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    if field.type in _INT64:
        return int(value)
    return value


def _d(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def statistics(stats: Sequence[VersionStats]) -> dict[str, Any]:
    """Triton's statistics extension JSON."""
    zero = {"count": 0, "ns": 0}
    out = []
    for v in stats:
        s = v.stats
        out.append(
            {
                "name": v.name,
                "version": v.version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": _d(s.success),
                    "fail": _d(s.fail),
                    "queue": _d(s.queue),
                    "compute_input": _d(s.compute_input),
                    "compute_infer": _d(s.compute_infer),
                    "compute_output": _d(s.compute_output),
                    "cache_hit": zero,
                    "cache_miss": zero,
                },
                "response_stats": {},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": _d(b.compute_input),
                        "compute_infer": _d(b.compute_infer),
                        "compute_output": _d(b.compute_output),
                    }
                    for size, b in sorted(s.batch_stats.items())
                ],
                "memory_usage": [],
            }
        )
    return {"model_stats": out}


def repository_index(entries: Sequence[RepositoryEntry]) -> list[dict[str, str]]:
    out = []
    for e in entries:
        item = {"name": e.name}
        if e.version:
            item["version"] = e.version
        if e.state:
            item["state"] = e.state
        if e.reason:
            item["reason"] = e.reason
        out.append(item)
    return out
