"""Per-row activation scales (toolchain/rowscales.py): a row's int8 result does not depend on its batch.

``quantize_dynamic`` computes one activation scale per tensor, batch included; the rewrite makes it one per row
(per token for [batch, seq, hidden]), with the zero point corrected exactly in int32. Checked on graphs the
quantizer itself writes (rank 2 and rank 3, a quantized activation feeding several matmuls), against the graph
before the rewrite, and through ``convert``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from octacloud.serving.onnxops import couples_rows, row_coupling
from octacloud.toolchain.convert import convert
from octacloud.toolchain.repository import ModelRepository
from octacloud.toolchain.rowscales import per_row_activation_scales
from octacloud.toolchain.sources import SourceOptions, load_source
from octacloud.toolchain.variants import to_int8_dynamic

from .conftest import MLP_INPUT, fast_options


def session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def out(s: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return np.asarray(s.run(None, {s.get_inputs()[0].name: x})[0])


def fp32_block(rank: int) -> onnx.ModelProto:
    """``c(relu(a(x)) * b(x))``: x feeds two matmuls (one quantized tensor, two MatMulIntegers), then a third."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32), name)

    inits = [weight("wa", 32, 48), weight("wb", 32, 48), weight("wc", 48, 8), weight("ba", 48), weight("bc", 8)]
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["xa"]),
        helper.make_node("Add", ["xa", "ba"], ["ya"]),
        helper.make_node("Relu", ["ya"], ["ra"]),
        helper.make_node("MatMul", ["x", "wb"], ["yb"]),
        helper.make_node("Mul", ["ra", "yb"], ["h"]),
        helper.make_node("MatMul", ["h", "wc"], ["hc"]),
        helper.make_node("Add", ["hc", "bc"], ["y"]),
    ]
    dims: list[str | int] = ["n", 32] if rank == 2 else ["n", "seq", 32]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def quantized(tmp_path: Path, rank: int) -> tuple[Path, Path]:
    """(fp32, int8 as quantize_dynamic writes it) for a [batch, 32] or [batch, seq, 32] input."""
    fp32, int8 = tmp_path / f"fp32_{rank}.onnx", tmp_path / f"int8_{rank}.onnx"
    onnx.save(fp32_block(rank), str(fp32))
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
    return fp32, int8


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return float((np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


@pytest.mark.parametrize("rank", [2, 3])
def test_a_rows_int8_result_is_bit_identical_alone_and_next_to_large_rows(tmp_path: Path, rank: int) -> None:
    fp32, int8 = quantized(tmp_path, rank)
    per_tensor = onnx.load(str(int8))
    per_row = onnx.load(str(int8))
    rewrite = per_row_activation_scales(per_row)
    assert rewrite.rewritten == 2 and rewrite.kept == ()  # x (feeding a and b) and the product feeding c
    onnx.checker.check_model(per_row, full_check=True)
    assert "DynamicQuantizeLinear" not in {n.op_type for n in per_row.graph.node}
    rng = np.random.default_rng(1)
    tail = (32,) if rank == 2 else (5, 32)
    mine = rng.normal(size=(3, *tail)).astype(np.float32)
    theirs = (rng.normal(size=(5, *tail)) * 1000).astype(np.float32)
    batch = np.concatenate([mine, theirs])
    new, old = session(per_row), session(per_tensor)
    alone = np.concatenate([out(new, mine[i : i + 1]) for i in range(3)])
    assert np.array_equal(out(new, batch)[:3], alone)
    assert np.array_equal(out(new, np.concatenate([theirs[:2], mine, theirs]))[2:5], alone)  # any position
    old_alone = np.concatenate([out(old, mine[i : i + 1]) for i in range(3)])
    assert not np.allclose(out(old, batch)[:3], old_alone, rtol=0.05, atol=0.05)  # the bug the rewrite removes
    reference = out(session(fp32), mine)
    assert cosine(alone, reference) > 0.999
    assert cosine(alone, reference) >= cosine(old_alone, reference) - 1e-4  # per row is no coarser than per tensor


def test_a_row_of_zeros_and_a_constant_row_quantize_like_dynamic_quantize_linear(tmp_path: Path) -> None:
    _, int8 = quantized(tmp_path, 2)
    per_row = onnx.load(str(int8))
    per_row_activation_scales(per_row)
    new, old = session(per_row), session(int8)
    for row in (np.zeros((1, 32), np.float32), np.full((1, 32), -3.5, np.float32), np.full((1, 32), 7.0, np.float32)):
        np.testing.assert_allclose(out(new, row), out(old, row), rtol=1e-5, atol=1e-5)
        assert np.isfinite(out(new, row)).all()


def test_a_quantized_activation_feeding_a_convolution_keeps_its_per_batch_scale() -> None:
    # ConvInteger wants a scalar x_zero_point and pads with it: not rewritten, and serving keeps isolating it.
    w = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.int8), "w")
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql"),
        helper.make_node("ConvInteger", ["q", "w", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 4, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.INT32, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
        ],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    rewrite = per_row_activation_scales(model)
    assert rewrite.rewritten == 0 and len(rewrite.kept) == 1 and rewrite.kept[0].startswith("dql: ")


def test_convert_writes_row_independent_int8_that_serving_batches(mlp_file: Path, tmp_path: Path) -> None:
    source = load_source(mlp_file, SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",), classifier=True))
    result = convert(source, ModelRepository(tmp_path / "repo"), fast_options(precisions=("int8",)))
    [variant] = result.published
    assert variant.parity.passed
    path = tmp_path / "repo" / "tiny_int8" / "1" / "model.onnx"
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops
    assert not couples_rows(path), row_coupling(path)


def test_to_int8_dynamic_reports_what_it_kept(tmp_path: Path) -> None:
    fp32, _ = quantized(tmp_path, 2)
    dst = tmp_path / "out.onnx"
    rewrite = to_int8_dynamic(fp32, dst)
    assert rewrite.rewritten == 2 and rewrite.kept == ()
    assert not couples_rows(dst)
    assert couples_rows(tmp_path / "int8_2.onnx")  # the quantizer's own output couples rows
