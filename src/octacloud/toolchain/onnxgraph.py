"""ONNX files: signatures, weight sizes, running them in onnxruntime, and offline graph optimisation.

Offline optimisation is onnxruntime's *basic* level only (constant folding, redundant-node elimination):
those rewrites are hardware-independent, so the published graph stays portable between the CPU and CUDA
execution providers. The fusions of the extended/all levels depend on the provider and are applied online
when the serving layer opens the session.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import numpy as np
import onnx
import onnxruntime as ort

from octacloud.toolchain.errors import ConversionError
from octacloud.toolchain.spec import TensorSpec, dtype_from_onnx

_ITEMSIZE: Final = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


def _specs(values: list[onnx.ValueInfoProto], skip: set[str]) -> list[TensorSpec]:
    specs = []
    for v in values:
        if v.name in skip:
            continue
        t = v.type.tensor_type
        dims: list[int | None] = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim
        ]
        if dims:
            dims[0] = None  # the batch axis
        specs.append(TensorSpec(v.name, dtype_from_onnx(t.elem_type), tuple(dims) or (None,)))
    return specs


def signature(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's (inputs, outputs); inputs that are also initializers (optional overrides) are left out."""
    initializers = {i.name for i in model.graph.initializer}
    return _specs(list(model.graph.input), initializers), _specs(list(model.graph.output), set())


def weights_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the weights (initializers, including ones in subgraphs) as stored in the model."""
    total = 0

    def visit(graph: onnx.GraphProto) -> None:
        nonlocal total
        for init in graph.initializer:
            total += math.prod(init.dims) * _ITEMSIZE.get(init.data_type, 4)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)
                elif attr.type == onnx.AttributeProto.TENSOR:
                    total += math.prod(attr.t.dims) * _ITEMSIZE.get(attr.t.data_type, 4)

    visit(model.graph)
    return total


def session_options(threads: int, level: ort.GraphOptimizationLevel | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if level is not None:
        so.graph_optimization_level = level
    return so


_NO_KERNEL = re.compile(
    r"Could not find an implementation for (\S+)|Fatal error: (\S+) is not a registered function/op"
)
_NO_SCHEMA = re.compile(
    r"No (?:Op|opset) registered for (\S+) with domain_version of (\d+)|"
    r"No Op registered for (\S+)"
)


def open_session(path: Path, threads: int = 1) -> ort.InferenceSession:
    """Open ``path`` on the CPU provider; an operator onnxruntime cannot run becomes a :class:`ConversionError`."""
    try:
        return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception classes, all unrelated to each other
        text = str(e)
        m = _NO_KERNEL.search(text) or _NO_SCHEMA.search(text)
        op = next((g for g in m.groups() if g), None) if m else None
        if op:
            raise ConversionError(
                f"{path.name}: onnxruntime has no implementation of operator {op!r} on the CPU; replace it in "
                f"the source model or register a custom-op library (onnxruntime said: {text.strip()[:300]})"
            ) from None
        raise ConversionError(f"{path.name}: onnxruntime cannot load the model: {text.strip()[:500]}") from None


def run(session: ort.InferenceSession, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``session``; a failure (bad shapes, a graph that hard-codes a batch size) is a ConversionError."""
    names = [o.name for o in session.get_outputs()]
    try:
        values = session.run(names, dict(inputs))
    except Exception as e:  # onnxruntime's exception classes are not exported as a hierarchy
        shapes = {k: list(v.shape) for k, v in inputs.items()}
        raise ConversionError(
            f"onnxruntime failed to run the model on inputs {shapes}: {str(e).strip()[:400]} — if the graph "
            "depends on a fixed batch size (e.g. a Reshape to a constant shape), re-export it with a dynamic "
            "batch axis"
        ) from None
    return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


def optimize_offline(src: Path, dst: Path) -> None:
    """Write ``src`` with onnxruntime's basic (portable) graph optimisations applied to ``dst``."""
    so = session_options(1, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    so.optimized_model_filepath = str(dst)
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except Exception:
        open_session(src)  # re-raise as a ConversionError that names the problem
        raise


def check_model(path: Path) -> onnx.ModelProto:
    """Load and validate an ONNX file (``onnx.checker``, full check with shape inference)."""
    try:
        model = onnx.load(str(path))
    except Exception as e:
        raise ConversionError(f"{path}: not a readable ONNX model: {e}") from None
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ConversionError(f"{path}: the ONNX model is invalid: {str(e).strip()[:500]}") from None
    return model
