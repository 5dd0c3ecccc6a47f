"""Provider selection: the model's config and the host's onnxruntime decide; nothing falls back silently."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.providers import CPU, CUDA, TENSORRT, choose_providers, gpu_visible

GPU_HOST = [TENSORRT, CUDA, CPU]
CPU_HOST = [CPU]


def _config(text: str = "") -> mc.ModelConfig:
    return text_format.Parse('name: "m"\n' + text, mc.ModelConfig())


TRT = 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" %s } ] } }'


@pytest.mark.parametrize(
    ("config", "available", "visible", "names", "device"),
    [
        ("", CPU_HOST, True, [CPU], "cpu"),
        ("", GPU_HOST, True, [CUDA, CPU], "cuda"),  # KIND_AUTO with a GPU: CUDA
        ("", GPU_HOST, False, [CPU], "cpu"),  # a CPU slice on a GPU host: never the card
        ("instance_group [ { kind: KIND_CPU } ]", GPU_HOST, True, [CPU], "cpu"),
        ("instance_group [ { kind: KIND_GPU } ]", GPU_HOST, True, [CUDA, CPU], "cuda"),
        (TRT % "", GPU_HOST, True, [TENSORRT, CUDA, CPU], "cuda"),
    ],
)
def test_choice_table(config: str, available: list[str], visible: bool, names: list[str], device: str) -> None:
    choice = choose_providers(_config(config), available, visible=visible)
    assert choice.names == names
    assert choice.device == device


@pytest.mark.parametrize(
    ("config", "available", "visible", "message"),
    [
        ("instance_group [ { kind: KIND_GPU } ]", CPU_HOST, True, "has no CUDAExecutionProvider"),
        ("instance_group [ { kind: KIND_GPU } ]", GPU_HOST, False, "no GPU is visible to this replica"),
        (TRT % "", [CUDA, CPU], True, "has no TensorrtExecutionProvider"),
        (TRT % "", CPU_HOST, True, "a TensorRT accelerator"),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "openvino" } ] } }',
            GPU_HOST,
            True,
            "'openvino' is not offered",
        ),
        (TRT % 'parameters { key: "precision_mode" value: "FP8" }', GPU_HOST, True, "precision_mode"),
    ],
)
def test_what_the_host_lacks_is_refused_by_name(config: str, available: list[str], visible: bool, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        choose_providers(_config(config), available, visible=visible)


def test_memory_budget_limits_the_cuda_arena_and_trt_options(tmp_path: Path) -> None:
    config = _config(TRT % 'parameters { key: "precision_mode" value: "FP16" }')
    choice = choose_providers(config, GPU_HOST, visible=True, memory_budget=2 << 30, trt_cache=tmp_path)
    trt, cuda, _ = (dict(o) for _, o in choice.providers)
    assert cuda["gpu_mem_limit"] == str(2 << 30)
    assert cuda["device_id"] == "0"  # CUDA_VISIBLE_DEVICES renumbers the slice's card
    assert trt["trt_fp16_enable"] == "True"
    assert trt["trt_engine_cache_path"] == str(tmp_path)
    assert trt["trt_max_workspace_size"] == str((2 << 30) // 4)


def test_gpu_visibility_follows_the_slice_environment() -> None:
    assert gpu_visible({}) is True
    assert gpu_visible({"CUDA_VISIBLE_DEVICES": "3"}) is True
    assert gpu_visible({"CUDA_VISIBLE_DEVICES": ""}) is False


def test_a_gpu_choice_never_falls_back_to_the_cpu_silently(tmp_path: Path) -> None:
    """A provider onnxruntime cannot open (some versions drop it quietly, newer ones raise) is a load error that
    names it, never a replica computing on the CPU instead (real onnxruntime, which has no CUDA here)."""
    from octacloud.serving.providers import ProviderChoice
    from octacloud.serving.runtime import OnnxRuntime
    from tests.cluster.conftest import write_linear_model

    folder = write_linear_model(tmp_path)
    choice = ProviderChoice(((CUDA, {}), (CPU, {})), "cuda")
    with pytest.raises(ModelConfigError, match="CUDAExecutionProvider"):
        OnnxRuntime(folder / "1" / "model.onnx", 1, choice)


class _FakeBinding:
    def __init__(self) -> None:
        self.inputs: dict[str, object] = {}
        self.outputs: list[tuple[str, str]] = []

    def bind_cpu_input(self, name: str, array: object) -> None:
        self.inputs[name] = array

    def bind_output(self, name: str, device: str, device_id: int = 0) -> None:
        self.outputs.append((name, f"{device}:{device_id}"))

    def copy_outputs_to_cpu(self) -> list[object]:
        return [f"{name}@{device}" for name, device in self.outputs]


class _FakeSession:
    def __init__(self) -> None:
        self.binding = _FakeBinding()
        self.bound_runs = 0

    def io_binding(self) -> _FakeBinding:
        return self.binding

    def run_with_iobinding(self, binding: _FakeBinding) -> None:
        assert binding is self.binding
        self.bound_runs += 1


def test_gpu_batches_go_through_io_binding() -> None:
    """On a GPU the batch's inputs are bound from host memory once and the outputs stay on the card until one
    copy back; a plain ``run`` is never used there."""
    import numpy as np

    from octacloud.serving.runtime import OnnxRuntime

    runtime = OnnxRuntime.__new__(OnnxRuntime)
    session = _FakeSession()
    runtime._session = session  # type: ignore[assignment]
    runtime._device_id = 1  # the second card of a two-card slice: the outputs stay on it
    x = np.ones((4, 16), dtype=np.float32)[:, ::2]  # not contiguous: binding needs a contiguous copy
    out = runtime._run_bound({"INPUT0": x}, ["OUTPUT0"])
    assert out == ["OUTPUT0@cuda:1"]
    assert session.bound_runs == 1
    bound = session.binding.inputs["INPUT0"]
    assert isinstance(bound, np.ndarray)
    assert bound.flags.c_contiguous
