"""Fixtures for cluster tests: a tiny real ONNX model in a Triton-layout repository, and a test fleet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

IN, OUT = 16, 4


def _weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.standard_normal((IN, OUT)).astype(np.float32), rng.standard_normal(OUT).astype(np.float32)


def expected_output(x: np.ndarray) -> np.ndarray:
    """What the test model computes: relu(x @ W + b)."""
    w, b = _weights()
    return np.maximum(x @ w + b, 0.0)


def write_linear_model(repo: Path, name: str = "linear") -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w, b = _weights()
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["INPUT0", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Z"]),
            helper.make_node("Relu", ["Z"], ["OUTPUT0"]),
        ],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", IN])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", OUT])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {IN} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {OUT} ] }} ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )
    return folder


@pytest.fixture
def linear_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    write_linear_model(repo)
    return repo
