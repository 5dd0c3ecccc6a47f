"""A zoo of fake runtimes (sum, echo, slow, error) for tests of the DataPlane, batcher and front ends, and
builders of real tiny ONNX models (these need the ``onnx`` package, a build-time dependency).

A fake model is a repository folder whose ``config.pbtxt`` says ``backend: "fake"`` and names its behaviour
in ``parameters { key: "behaviour" value { string_value: "sum" } }``; pass :func:`fake_runtimes` (or
:func:`runtimes_with_fakes`) to the repository.

| behaviour | inputs → outputs |
|---|---|
| ``sum`` | ``INPUT0``, ``INPUT1`` FP32 [-1, 4] → ``OUTPUT0`` = sum |
| ``echo`` | ``INPUT0`` (any datatype of the config) → ``OUTPUT0`` = the input |
| ``slow`` | like echo, after sleeping ``delay_ms`` (parameter, default 200) |
| ``pid`` | ``INPUT0`` → ``OUTPUT0`` of its shape, every value the computing process's id (after ``delay_ms``) |
| ``device`` | like ``pid``, every value the GPU the fake was placed on (-1: the CPU) |
| ``error`` | raises on every batch with a nonzero input (warm-up sends zeros, so it loads) |

Any fake takes ``close_delay_ms`` (parameter, default 0): its ``close`` sleeps that long, as freeing a large
model takes a while. ``FakeRuntimeFactory(gpus=N)`` pretends the replica sees N GPUs: instances are then placed
on them as on a GPU host (``serving/instances.py``), and each fake records the GPU its config put it on.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from octacloud.serving.providers import GPU_KINDS, config_device
from octacloud.serving.repository.config import ModelConfig, datatype_of_enum, parameter
from octacloud.serving.runtime import Arrays, ModelRuntime, RuntimeFactory, default_runtimes
from octacloud.serving.types import TensorMetadata

FAKE_BACKEND = "fake"


class FakeRuntime:
    """A runtime computing in numpy; records the batch sizes it ran (``batches``)."""

    def __init__(
        self,
        behaviour: str,
        inputs: Sequence[TensorMetadata],
        outputs: Sequence[TensorMetadata],
        delay_s: float = 0.0,
        close_delay_s: float = 0.0,
        gpu: int | None = None,
        overlap: Overlap | None = None,
    ) -> None:
        self.behaviour = behaviour
        self.overlap = overlap or Overlap()
        self.gpu = gpu
        """The GPU the config placed it on (``FakeRuntimeFactory(gpus=N)``), None for the CPU."""
        self.close_delay_s = close_delay_s
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.calls = 0
        self.closed = False
        self._lock = threading.Lock()

    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return self._outputs

    @property
    def device(self) -> str:
        return "cpu"

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        with self._lock:
            self.calls += 1
            first = next(iter(inputs.values()))
            rows = int(first.shape[0]) if first.ndim else 1
            self.batches.append(rows)
        if self.behaviour == "error" and any(np.any(a) for a in inputs.values()):
            raise RuntimeError("the fake model failed on purpose")
        if self.delay_s:
            self.overlap.enter(rows)
            try:
                time.sleep(self.delay_s)
            finally:
                self.overlap.leave(rows)
        if self.behaviour in ("pid", "device"):
            first = next(iter(inputs.values()))
            value = os.getpid() if self.behaviour == "pid" else (-1 if self.gpu is None else self.gpu)
            return dict.fromkeys(outputs, np.full(first.shape, value, first.dtype))
        sums = self.behaviour == "sum"
        result = inputs["INPUT0"] + inputs["INPUT1"] if sums else next(iter(inputs.values()))
        return dict.fromkeys(outputs, result)

    def close(self) -> None:
        if self.close_delay_s:
            time.sleep(self.close_delay_s)
        self.closed = True


class Overlap:
    """How many rows the delayed runs of a factory's fakes had under way at once, batched together or run side
    by side: ``peak`` is the most seen together (a test's proof that requests were not served one after the
    other, without timing them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def enter(self, rows: int) -> None:
        with self._lock:
            self.running += rows
            self.peak = max(self.peak, self.running)

    def leave(self, rows: int) -> None:
        with self._lock:
            self.running -= rows

    def reset(self) -> None:
        with self._lock:
            self.peak = self.running

    def __getstate__(self) -> dict[str, Any]:
        """A compute process gets a tracker of its own (its runs are not counted here)."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


class FakeRuntimeFactory:
    """Builds a :class:`FakeRuntime` from the config (which must declare its inputs and outputs)."""

    platform = "fake"
    backend = FAKE_BACKEND

    def __init__(self, gpus: int = 0) -> None:
        self.created: list[FakeRuntime] = []
        self.visible_gpus = gpus
        self.overlap = Overlap()
        """Rows under way at once over every fake this factory made (in this process)."""

    def gpus(self) -> int:
        """How many GPUs the fake replica pretends to see."""
        return self.visible_gpus

    def __getstate__(self) -> dict[str, Any]:
        """What a compute process gets (``compute: "process"`` pickles the factory): not the runtimes created
        in this process, which hold locks."""
        return {**self.__dict__, "created": []}

    def __call__(self, version_dir: Path, config: ModelConfig, threads: int) -> ModelRuntime:
        from octacloud.serving.errors import ModelConfigError

        if not version_dir.is_dir():
            raise ModelConfigError(f"{version_dir} is missing")
        behaviour = parameter(config, "behaviour") or "echo"
        batch = (-1,) if config.max_batch_size > 0 else ()

        def meta(entries: Any) -> list[TensorMetadata]:
            return [TensorMetadata(e.name, datatype_of_enum(e.data_type), (*batch, *map(int, e.dims))) for e in entries]

        delay = float(parameter(config, "delay_ms") or (200 if behaviour == "slow" else 0)) / 1000
        close_delay = float(parameter(config, "close_delay_ms") or 0) / 1000
        on_gpu = self.visible_gpus > 0 and any(g.kind in GPU_KINDS for g in config.instance_group)
        gpu = config_device(config) if on_gpu else None
        runtime = FakeRuntime(behaviour, meta(config.input), meta(config.output), delay, close_delay, gpu, self.overlap)
        self.created.append(runtime)
        return runtime


def runtimes_with_fakes(fake: FakeRuntimeFactory | None = None) -> dict[str, RuntimeFactory]:
    """ONNX Runtime plus the fake backend."""
    return {**default_runtimes(), FAKE_BACKEND: fake or FakeRuntimeFactory()}


def fake_config(
    behaviour: str, *, datatype: str = "TYPE_FP32", dims: str = "4", max_batch_size: int = 8, extra: str = ""
) -> str:
    """A config.pbtxt for a fake model."""
    inputs = f'input [{{ name: "INPUT0" data_type: {datatype} dims: [{dims}] }}'
    if behaviour == "sum":
        inputs += f', {{ name: "INPUT1" data_type: {datatype} dims: [{dims}] }}'
    return (
        f'backend: "{FAKE_BACKEND}"\nmax_batch_size: {max_batch_size}\n{inputs}]\n'
        f'output [{{ name: "OUTPUT0" data_type: {datatype} dims: [{dims}] }}]\n'
        f'parameters {{ key: "behaviour" value {{ string_value: "{behaviour}" }} }}\n{extra}'
    )


def write_fake_model(repo: Path, name: str, behaviour: str, versions: Sequence[int] = (1,), **kw: Any) -> Path:
    model = repo / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(fake_config(behaviour, **kw))
    for v in versions:
        (model / str(v)).mkdir(exist_ok=True)
    return model


# ---- real tiny ONNX models (need the onnx package) ---------------------------------------------------------
def mlp_onnx(sizes: Sequence[int] = (256, 1024, 1024, 10), seed: int = 0) -> bytes:
    """An MLP (Gemm + Relu between layers) with input ``input`` FP32 [-1, sizes[0]] and output ``output``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "input"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}")]
        y = "output" if i == len(sizes) - 2 else f"h{i}"
        gemm = f"g{i}" if y != "output" else y
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [gemm]))
        if y != "output":
            nodes.append(helper.make_node("Relu", [gemm], [y]))
        x = y
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def add_onnx(dims: int = 4, batch: bool = True) -> bytes:
    """``OUTPUT0 = INPUT0 + INPUT1`` (FP32); with a dynamic batch dim when ``batch``."""
    import onnx
    from onnx import TensorProto, helper

    shape: list[Any] = ["batch", dims] if batch else [dims]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"])],
        "add",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def write_onnx_model(
    repo: Path, name: str, model: bytes, config: str | None = None, versions: Sequence[int] = (1,)
) -> Path:
    """``<repo>/<name>/<v>/model.onnx`` for each version, and ``config.pbtxt`` when given."""
    folder = repo / name
    for v in versions:
        (folder / str(v)).mkdir(parents=True, exist_ok=True)
        (folder / str(v) / "model.onnx").write_bytes(model)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder
