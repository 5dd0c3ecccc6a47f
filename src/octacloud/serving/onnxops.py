"""Which operators an ONNX file uses, read straight from its protobuf wire format (serving needs no ``onnx``).

Used to find models whose rows are **coupled within a batch**: dynamic quantization as
``onnxruntime.quantization.quantize_dynamic`` writes it (``DynamicQuantizeLinear`` and the integer ops it feeds)
computes one activation scale and zero point over the whole batch tensor, so one request's results would depend
on the other requests batched with it, possibly another tenant's.

The rule is structural, not a list of names: a graph couples rows when it has an operator that computes
quantization parameters from the whole tensor (``DynamicQuantizeLinear``, ``DynamicQuantizeMatMul``,
``DynamicQuantizeLSTM``), or an operator that applies them (``QuantizeLinear``'s scale or zero point,
``MatMulInteger``'s ``a_zero_point``, ``ConvInteger``'s ``x_zero_point``) fed from a value computed at run time
rather than a constant: onnxruntime takes those only as scalars (or, for ``QuantizeLinear``, per channel), so a
value computed from the activations is shared by every row. The toolchain's int8 models
(:mod:`octacloud.toolchain.rowscales`) quantize each row with its own scale and a constant zero point of 0,
correcting the product exactly, and are not coupled. A graph that couples rows some other way (its own
reduction over the batch axis, in any precision) is not recognised: its config can ask for isolation
(``batch_isolation: "requests"``, serving/model.py).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

DYNAMIC_SCALE_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})
"""Operators that compute one activation scale over their whole input tensor, batch axis included."""
QUANT_PARAM_INPUTS = {"QuantizeLinear": (1, 2), "MatMulInteger": (2,), "ConvInteger": (2,)}
"""Operators whose quantization parameters (input positions) must be constants for rows to stay independent."""
ROW_COUPLING_OPS = DYNAMIC_SCALE_OPS | frozenset(QUANT_PARAM_INPUTS)
"""Every operator the rule above looks at."""

_MODEL_GRAPH, _MODEL_FUNCTIONS = 7, 25  # ModelProto.graph, ModelProto.functions
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15  # GraphProto
_FUNCTION_NODE = 7  # FunctionProto.node
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 2, 4, 5  # NodeProto
_TENSOR_NAME, _SPARSE_VALUES = 8, 1  # TensorProto.name, SparseTensorProto.values
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


def _text(value: memoryview) -> str:
    return bytes(value).decode(errors="replace")


@dataclass(slots=True)
class _Scan:
    ops: set[str]
    coupling: list[str]
    """Why the graph couples rows, one line per reason (empty: rows are independent)."""


def _graph(graph: memoryview, node_field: int, outer: frozenset[str], scan: _Scan, depth: int = 0) -> None:
    """Scan one graph (or function body); ``outer``: the constants visible from enclosing graphs."""
    if depth > 16:
        return
    nodes: list[tuple[str, list[str], list[memoryview]]] = []
    constants = set(outer)
    for number, payload in _fields(graph):
        if number == node_field:
            op, inputs, outputs, subgraphs = "", [], [], []
            for field, value in _fields(payload):
                if field == _NODE_OP_TYPE:
                    op = _text(value)
                elif field == _NODE_INPUT:
                    inputs.append(_text(value))
                elif field == _NODE_OUTPUT:
                    outputs.append(_text(value))
                elif field == _NODE_ATTRIBUTE:
                    subgraphs += [sub for a, sub in _fields(value) if a in (_ATTR_G, _ATTR_GRAPHS)]
            nodes.append((op, inputs, subgraphs))
            if op == "Constant":
                constants.update(outputs)
        elif number in (_GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER) and node_field == _GRAPH_NODE:
            tensor = payload
            if number == _GRAPH_SPARSE_INITIALIZER:
                tensor = next((v for f, v in _fields(payload) if f == _SPARSE_VALUES), memoryview(b""))
            constants.update(_text(v) for f, v in _fields(tensor) if f == _TENSOR_NAME)
    visible = frozenset(constants)
    for op, inputs, subgraphs in nodes:
        scan.ops.add(op)
        if op in DYNAMIC_SCALE_OPS:
            scan.coupling.append(f"{op} computes one scale over the whole batch")
        for i in QUANT_PARAM_INPUTS.get(op, ()):
            if i < len(inputs) and inputs[i] and inputs[i] not in visible:
                scan.coupling.append(f"{op}'s input {i} ({inputs[i]!r}) is computed at run time")
        for sub in subgraphs:
            _graph(sub, _GRAPH_NODE, visible, scan, depth + 1)


def _scan(model: memoryview, scan: _Scan) -> None:
    for number, payload in _fields(model):
        if number == _MODEL_GRAPH:
            _graph(payload, _GRAPH_NODE, frozenset(), scan)
        elif number == _MODEL_FUNCTIONS:
            _graph(payload, _FUNCTION_NODE, frozenset(), scan)


def scan_model(path: Path | str) -> _Scan:
    """Every ``op_type`` in the model's graph, its subgraphs and its local functions, and why its rows are
    coupled (the file is mapped, not read: weights are skipped by length). Raises ``ValueError`` for a file
    that is not protobuf."""
    scan = _Scan(set(), [])
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return scan
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                _scan(view, scan)  # every slice of the map dies with _scan's frame
            finally:
                view.release()
    return scan


def op_types(path: Path | str) -> set[str]:
    """Every ``op_type`` in the model (see :func:`scan_model`)."""
    return scan_model(path).ops


def row_coupling(path: Path | str) -> list[str]:
    """Why the model at ``path`` computes some rows' results from other rows of the batch (empty: it does not)."""
    return list(dict.fromkeys(scan_model(path).coupling))


def couples_rows(path: Path | str) -> bool:
    """Whether the model at ``path`` computes some rows' results from other rows of the batch."""
    return bool(row_coupling(path))
