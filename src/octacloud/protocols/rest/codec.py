"""JSON (and Triton binary tensor data) for the REST front end."""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def decode_infer(body: bytes, header_length: int | None, model: str, version: str) -> InferenceRequest:
    """An :class:`InferenceRequest` from a JSON body, or a JSON header followed by binary tensor data.

    Every field is checked for its JSON type (names and datatypes strings, shapes lists of integers, parameters
    objects, outputs a list of objects), so that a malformed request is an :class:`InvalidInputError`."""
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


def encode_infer(response: InferenceResponse, request: InferenceRequest) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the length of its JSON header."""
    binary_all = bool(request.parameters.get("binary_data_output", False))
    binary_of = {o.name: bool(o.parameters.get("binary_data", binary_all)) for o in request.outputs}
    chunks: list[bytes] = []
    outputs = []
    for t in response.outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary_of.get(t.name, binary_all):
            raw = to_raw(t.data)
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
