"""Fixtures of the serving tests: repositories of fake models and tiny ONNX models built here."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.serving.testing import FakeRuntimeFactory, add_onnx, write_fake_model, write_onnx_model

ADD_CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] } ]
"""


@pytest.fixture
def fakes() -> FakeRuntimeFactory:
    return FakeRuntimeFactory()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """add (ONNX, full config), add_auto (ONNX, no config), sum and slow (fake)."""
    root = tmp_path / "models"
    write_onnx_model(root, "add", add_onnx(), ADD_CONFIG)
    write_onnx_model(root, "add_auto", add_onnx())
    write_fake_model(root, "sum", "sum")
    write_fake_model(root, "slow", "slow", extra='parameters { key: "delay_ms" value { string_value: "150" } }')
    return root
