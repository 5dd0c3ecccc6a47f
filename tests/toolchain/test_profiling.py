"""Measuring a profile on graphs whose answers are known by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from octacloud.toolchain.onnxgraph import weights_bytes
from octacloud.toolchain.profiling import ProfileSettings, measure_bytes_per_sample, measure_profile
from octacloud.toolchain.spec import TensorSpec

X = TensorSpec("x", "float32", (None, 4))
SETTINGS = ProfileSettings(threads=1, batch_sizes=(1, 2, 4, 64), budget_s=0.0, min_iterations=2)


def diamond() -> onnx.ModelProto:
    """x → Relu → a → Relu → b;  y = a + b.  Live at the Add: a, b and y (x died after the first Relu)."""
    vi = oh.make_tensor_value_info
    nodes = [
        oh.make_node("Relu", ["x"], ["a"]),
        oh.make_node("Relu", ["a"], ["b"]),
        oh.make_node("Add", ["a", "b"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes, "diamond", [vi("x", onnx.TensorProto.FLOAT, ["N", 4])], [vi("y", onnx.TensorProto.FLOAT, ["N", 4])]
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_bytes_per_sample_is_the_peak_of_live_tensors_per_sample() -> None:
    # three float32 [4] tensors live at once: 3 * 16 bytes per sample
    assert measure_bytes_per_sample(diamond(), [X], SETTINGS) == 48


def test_weights_are_the_initializers() -> None:
    model = diamond()
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((10, 3), np.float16), "w"))
    assert weights_bytes(model) == 10 * 3 * 2


def test_a_profile_measures_each_batch_size_up_to_the_max(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(diamond(), path)
    profile = measure_profile("diamond", "fp32", path, [X], max_batch_size=4, settings=SETTINGS)
    assert [b.batch_size for b in profile.batches] == [1, 2, 4]  # 64 > max_batch_size
    assert all(b.iterations >= 2 and b.samples_per_s > 0 for b in profile.batches)
    assert profile.bytes_per_sample == 48 and profile.weights_bytes == 0
    assert profile.sample_shapes == {"x": (4,)} and profile.threads == 1


@pytest.mark.parametrize("hint", [8, 32])
def test_dynamic_axes_are_measured_at_the_hinted_size(hint: int) -> None:
    vi = oh.make_tensor_value_info
    graph = oh.make_graph(
        [oh.make_node("Relu", ["t"], ["u"])],
        "seq",
        [vi("t", onnx.TensorProto.FLOAT, ["N", "S"])],
        [vi("u", onnx.TensorProto.FLOAT, ["N", "S"])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    spec = TensorSpec("t", "float32", (None, None))
    settings = ProfileSettings(threads=1, shape_hints={"t": hint})
    assert measure_bytes_per_sample(model, [spec], settings) == 2 * hint * 4
