"""bench/gpu.py: ready to run in one command on an NVIDIA machine, and a clear refusal anywhere else."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.observability.dcgm import open_nvml

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(open_nvml() is not None, reason="this machine has an NVIDIA GPU: the bench would run")
def test_refuses_clearly_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--seconds", "1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "no NVIDIA GPU" in done.stderr


def test_batching_off_variant_is_a_valid_config_without_dynamic_batching(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "bert_base" / "1").mkdir(parents=True)
    (models / "bert_base" / "1" / "model.onnx").write_bytes(b"onnx")
    (models / "bert_base" / "config.pbtxt").write_text(
        'name: "bert_base"\nmax_batch_size: 32\ndynamic_batching {\n  max_queue_delay_microseconds: 2000\n}\n'
        'parameters {\n  key: "octacloud.precision"\n  value {\n    string_value: "fp32"\n  }\n}\n'
    )
    bench = _bench()
    on = bench.one_model_repo(models, "bert_base", tmp_path / "out", True)
    off = bench.one_model_repo(models, "bert_base", tmp_path / "out", False)
    parsed_on = text_format.Parse((on / "bert_base" / "config.pbtxt").read_text(), mc.ModelConfig())
    parsed_off = text_format.Parse((off / "bert_base" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert parsed_on.HasField("dynamic_batching")
    assert not parsed_off.HasField("dynamic_batching")
    assert parsed_off.max_batch_size == 32 and parsed_off.parameters["octacloud.precision"].string_value == "fp32"
    assert (off / "bert_base" / "1" / "model.onnx").read_bytes() == b"onnx"
