"""Per-row activation scales for dynamically quantized graphs, so that batched requests never change each other.

``quantize_dynamic`` quantizes each activation with ``DynamicQuantizeLinear``: one scale and zero point computed
over the **whole** tensor, batch axis included. In a batch, one request's large inputs then coarsen every other
request's quantization grid, and a request's int8 result depends on whom it was batched with (in a served cloud:
another tenant). This rewrite replaces each such node by the same computation done **per row** over the last
axis: per sample for a ``[batch, features]`` activation, per token for ``[batch, seq, hidden]``, which is finer
and just as isolating. Per row, it is exactly ``DynamicQuantizeLinear``'s formula::

    lo, hi = min(0, min(x)), max(0, max(x))          # over the last axis, kept as [..., 1]
    scale  = (hi - lo) / 255                          # hi at least 2^-100: never 0
    zp     = -round(lo / scale)                       # in [0, 255]
    q      = uint8(clip(round(x / scale) + zp, 0, 255))

The scale, now ``[..., 1]``, still multiplies the weight scale and the integer product by broadcasting. The zero
point cannot stay an input of ``MatMulInteger``: the operator allows a per-row ``a_zero_point``, but onnxruntime's
kernel accepts only a scalar ("input1 zero point must be a scalar or 1D tensor of size 1"). So the product is taken
with zero point 0 and corrected exactly, in int32::

    sum_k (q - zp) (w - wzp)  =  MatMulInteger(q, W, 0, wzp)  +  (-zp) * sum_k (w - wzp)

with the weight's column sums a constant. Every step is either integer-exact or elementwise along a row, so a row's
result is bit-identical whatever else is in the batch. Weights are untouched (7-bit, see :mod:`.variants`).

Only a ``DynamicQuantizeLinear`` whose outputs feed nothing but ``MatMulInteger`` (as its ``A`` with a constant
``B``) and ``Mul`` (the scale) is rewritten; any other one (e.g. feeding ``ConvInteger``, whose ``x_zero_point``
onnxruntime also wants scalar and whose padding uses it) is left as it is, and the serving layer keeps never
batching that model's requests together (:mod:`octacloud.serving.onnxops`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_QMAX = 255.0
_TINY = 2.0**-100
"""The least ``max(0, max(x))``: keeps the scale normal and nonzero; a row whose largest value is below it differs
from ``DynamicQuantizeLinear`` (which then uses scale 1) only in values that small."""


@dataclass(frozen=True, slots=True)
class RowScaleRewrite:
    """What :func:`per_row_activation_scales` did: nodes rewritten, and ones left per-tensor with the reason."""

    rewritten: int
    kept: tuple[str, ...]
    """One line per ``DynamicQuantizeLinear`` left as it was: its name and why."""


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


class _Builder:
    def __init__(self, model: onnx.ModelProto, prefix: str) -> None:
        self.graph = model.graph
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0

    def name(self, what: str) -> str:
        self._n += 1
        return f"{self.prefix}/{what}_{self._n}"

    def const(self, what: str, value: np.ndarray) -> str:
        name = self.name(what)
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: int | list[int]) -> str:
        out = output or self.name(op_type.lower())
        node = helper.make_node(op_type, inputs, [out], name=self.name(op_type))
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
        self.nodes.append(node)
        return out


def _quantize_rows(b: _Builder, x: str, q: str, scale: str, opset: int) -> str:
    """Nodes computing ``q`` (uint8) and ``scale`` ([..., 1] float) per row of ``x``; returns minus the zero point
    (int32). Fourteen small nodes: onnxruntime's cost per node, not per element, dominates at small batches."""
    zero = b.const("zero", np.array(0.0, np.float32))
    tiny = b.const("tiny", np.array(_TINY, np.float32))
    qmax = b.const("qmax", np.array(_QMAX, np.float32))
    if opset >= 18:
        axes = b.const("axes", np.array([-1], np.int64))
        lo = b.op("ReduceMin", [x, axes], keepdims=1)
        hi = b.op("ReduceMax", [x, axes], keepdims=1)
    else:
        lo = b.op("ReduceMin", [x], axes=[-1], keepdims=1)
        hi = b.op("ReduceMax", [x], axes=[-1], keepdims=1)
    lo = b.op("Min", [lo, zero])
    hi = b.op("Max", [hi, tiny])  # > 0, so the scale is never 0 (a row of zeros quantizes to zeros either way)
    b.op("Div", [b.op("Sub", [hi, lo]), qmax], scale)
    minus_zp = b.op("Round", [b.op("Div", [lo, scale])])  # in [-255, 0]: lo <= 0 and -lo <= hi - lo
    levels = b.op("Clip", [b.op("Sub", [b.op("Round", [b.op("Div", [x, scale])]), minus_zp]), zero, qmax])
    b.op("Cast", [levels], q, to=TensorProto.UINT8)
    return b.op("Cast", [minus_zp], to=TensorProto.INT32)


def _column_sums(weight: np.ndarray, zero_point: np.ndarray | None) -> np.ndarray:
    w = weight.astype(np.int32)
    if zero_point is not None:
        w = w - zero_point.astype(np.int32)
    sums: np.ndarray = w.sum(axis=-2).astype(np.int32)
    return sums


Uses = dict[str, list[tuple[onnx.NodeProto, int]]]
"""Per tensor name: the nodes that read it, with the input index."""


def per_row_activation_scales(model: onnx.ModelProto) -> RowScaleRewrite:
    """Rewrite ``model`` in place (see the module docstring); returns what was rewritten and what was kept."""
    graph = model.graph
    opset = _opset(model)
    inits = {t.name: t for t in graph.initializer}
    nodes = list(graph.node)  # one wrapper per node, so that identities below are stable
    uses: Uses = defaultdict(list)
    for node in nodes:
        for i, name in enumerate(node.input):
            uses[name].append((node, i))
    outputs = {o.name for o in graph.output}
    kept: list[str] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(node) → the nodes that take its place
    changed: set[str] = set()
    rewritten = 0
    for node in nodes:
        if node.op_type != "DynamicQuantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        label = node.name or node.output[0]
        x, q, scale, _ = node.input[0], *node.output
        matmuls = [n for n, _ in uses[q]]
        why = _why_kept(node, uses, inits, outputs, opset)
        if why:
            kept.append(f"{label}: {why}")
            continue
        b = _Builder(model, f"{label}/rowscale")
        minus_zp = _quantize_rows(b, x, q, scale, opset)
        replaced[id(node)] = b.nodes
        rewritten += 1
        changed |= {scale, *(n.output[0] for n, _ in uses[scale])}
        u8_zero = b.const("a_zero_point", np.array(0, np.uint8))
        for mm in matmuls:
            replaced[id(mm)] = _corrected_matmul(model, mm, inits, minus_zp, u8_zero)
    if replaced:
        _replace_nodes(graph, nodes, replaced, changed)
    return RowScaleRewrite(rewritten, tuple(kept))


def _why_kept(
    node: onnx.NodeProto, uses: Uses, inits: dict[str, onnx.TensorProto], outputs: set[str], opset: int
) -> str:
    """Why a DynamicQuantizeLinear node cannot be rewritten ('' : it can)."""
    q, scale, zp = node.output
    matmuls = [n for n, _ in uses[q]]
    if opset < 13:
        return f"opset {opset} < 13"
    if {q, scale, zp} & outputs:
        return "its outputs are graph outputs"
    if not matmuls or any(n.op_type != "MatMulInteger" or i != 0 for n, i in uses[q]):
        return "its quantized tensor feeds an operator other than MatMulInteger's A"
    if any(len(n.input) < 3 or n.input[2] != zp for n in matmuls) or len(uses[zp]) != len(matmuls):
        return "its zero point is used other than as MatMulInteger's a_zero_point"
    if any(n.op_type != "Mul" for n, _ in uses[scale]):
        return "its scale feeds an operator other than Mul"
    if any(n.input[1] not in inits or len(inits[n.input[1]].dims) != 2 for n in matmuls):
        return "a MatMulInteger's B is not a 2-D constant"
    if any(len(n.input) > 3 and n.input[3] and n.input[3] not in inits for n in matmuls):
        return "a MatMulInteger's b_zero_point is not a constant"
    return ""


def _corrected_matmul(
    model: onnx.ModelProto,
    mm: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    minus_zp: str,
    u8_zero: str,
) -> list[onnx.NodeProto]:
    """``mm`` with a zero point of 0, then the correction ``- zp * column_sums(B)`` that restores its product."""
    after = _Builder(model, f"{mm.name or mm.output[0]}/rowscale")
    weight = numpy_helper.to_array(inits[mm.input[1]])
    wzp = numpy_helper.to_array(inits[mm.input[3]]) if len(mm.input) > 3 and mm.input[3] else None
    sums = after.const("column_sums", _column_sums(weight, wzp))
    product = mm.output[0]
    mm.input[2] = u8_zero
    mm.output[0] = after.name("uncorrected")
    after.op("Add", [mm.output[0], after.op("Mul", [minus_zp, sums])], product)
    return [mm, *after.nodes]


def _replace_nodes(
    graph: onnx.GraphProto,
    nodes: list[onnx.NodeProto],
    replaced: dict[int, list[onnx.NodeProto]],
    changed: set[str],
) -> None:
    """Put the replacements in their nodes' places, in order; drop the shapes recorded for changed tensors."""
    order = [n for node in nodes for n in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(order)
    keep = [v for v in graph.value_info if v.name not in changed]
    del graph.value_info[:]
    graph.value_info.extend(keep)
