"""Which operators an ONNX file uses, read straight from its protobuf wire format (serving needs no ``onnx``).

Used to find models whose rows are **coupled within a batch**: dynamic quantization
(``DynamicQuantizeLinear`` and the integer ops it feeds, as ``onnxruntime.quantization.quantize_dynamic``
writes them) computes one activation scale over the whole batch tensor, so one request's results would
depend on the other requests batched with it, possibly another tenant's.
"""

from __future__ import annotations

import mmap
from pathlib import Path

ROW_COUPLING_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul"})
"""Operators whose result for one row depends on the other rows of the batch (a per-tensor dynamic scale)."""

_MODEL_GRAPH, _MODEL_FUNCTIONS = 7, 25  # ModelProto.graph, ModelProto.functions
_GRAPH_NODE = 1  # GraphProto.node
_FUNCTION_NODE = 7  # FunctionProto.node
_NODE_OP_TYPE, _NODE_ATTRIBUTE = 4, 5  # NodeProto.op_type, NodeProto.attribute
_ATTR_G, _ATTR_GRAPHS = 6, 11  # AttributeProto.g, AttributeProto.graphs (subgraphs of If/Loop/Scan)


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated or malformed protobuf varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview) -> list[tuple[int, memoryview]]:
    """The length-delimited fields of one message (others skipped): (field number, payload)."""
    out = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated protobuf field")
            out.append((number, buf[i : i + n]))
            i += n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


def _graph_ops(graph: memoryview, node_field: int, ops: set[str], depth: int = 0) -> None:
    if depth > 16:
        return
    for number, node in _fields(graph):
        if number != node_field:
            continue
        for field, value in _fields(node):
            if field == _NODE_OP_TYPE:
                ops.add(bytes(value).decode(errors="replace"))
            elif field == _NODE_ATTRIBUTE:
                for a, sub in _fields(value):
                    if a in (_ATTR_G, _ATTR_GRAPHS):
                        _graph_ops(sub, _GRAPH_NODE, ops, depth + 1)


def _scan(model: memoryview, ops: set[str]) -> None:
    for number, payload in _fields(model):
        if number == _MODEL_GRAPH:
            _graph_ops(payload, _GRAPH_NODE, ops)
        elif number == _MODEL_FUNCTIONS:
            _graph_ops(payload, _FUNCTION_NODE, ops)


def op_types(path: Path | str) -> set[str]:
    """Every ``op_type`` in the model's graph, its subgraphs and its local functions (the file is mapped,
    not read: weights are skipped by length). Raises ``ValueError`` for a file that is not protobuf."""
    ops: set[str] = set()
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return ops
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                _scan(view, ops)  # every slice of the map dies with _scan's frame
            finally:
                view.release()
    return ops


def couples_rows(path: Path | str) -> bool:
    """Whether the model at ``path`` computes some rows' results from other rows of the batch."""
    return bool(op_types(path) & ROW_COUPLING_OPS)
