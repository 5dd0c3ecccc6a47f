"""Model runtimes: what computes a batch. ONNX Runtime here: on the providers the model's config and the host
allow (TensorRT, CUDA, the CPU; :mod:`octacloud.serving.providers`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.memory import MEMORY_ENV
from octacloud.serving.onnxops import couples_rows
from octacloud.serving.providers import CPU, CUDA, ProviderChoice, choose_providers, gpu_visible, visible_gpu_count
from octacloud.serving.repository.config import ONNX_BACKEND, ONNX_PLATFORM, ModelConfig
from octacloud.serving.types import TensorMetadata

Arrays = Mapping[str, npt.NDArray[Any]]

THREADS_ENV = "OCTACLOUD_THREADS"


class ModelRuntime(Protocol):
    """A loaded model that computes whole batches.

    Implementations guarantee: ``inputs``/``outputs`` describe the model as it is (shapes include the batch
    dim, -1 where dynamic); :meth:`run` is called from a worker thread, one call at a time per runtime, with
    arrays already checked against the config, and returns every name in ``outputs`` with the batch dim
    first; it may raise any exception (the batch then fails, the server does not). :meth:`close` frees
    the model's memory; no call follows it.

    A runtime may also have ``couples_rows: bool``: True when a row's result depends on the other rows of its
    batch (per-batch dynamic quantization), so that only one tenant's requests share a batch (absent: False).
    """

    @property
    def inputs(self) -> Sequence[TensorMetadata]: ...

    @property
    def outputs(self) -> Sequence[TensorMetadata]: ...

    @property
    def device(self) -> str: ...

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]: ...

    def close(self) -> None: ...


class RuntimeFactory(Protocol):
    """Loads one version of a model. ``config`` may be partial (not auto-completed yet).

    ``platform``/``backend`` are what :func:`complete_config` writes into a config that names neither.
    Raises :class:`ModelConfigError` for a missing or broken model file.
    """

    platform: str
    backend: str

    def __call__(self, version_dir: Path, config: ModelConfig, threads: int) -> ModelRuntime: ...


def thread_budget(threads: int | None = None) -> int:
    """The replica's CPU thread budget: ``threads``, else ``$OCTACLOUD_THREADS``, else every core."""
    if threads:
        return threads
    env = os.environ.get(THREADS_ENV, "")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ModelConfigError(f"{THREADS_ENV} must be a positive integer, got {env!r}") from None
        if value > 0:
            return value
    return os.cpu_count() or 1


_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


class OnnxRuntime:
    """One ``onnxruntime.InferenceSession`` on the providers of ``choice`` (see :mod:`octacloud.serving.providers`;
    default: the CPU). On a GPU, batches go through I/O binding: inputs are copied to the card once and outputs
    come back once, with no intermediate host copies."""

    def __init__(self, path: Path, threads: int, choice: ProviderChoice | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Replicas share a host's cores with other replicas and the gateway: idle intra-op threads must sleep,
        # not spin (onnxruntime's default), or they burn the CPU the neighbours' slices paid for.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        choice = choice or ProviderChoice(((CPU, {}),), "cpu")
        try:
            self._session = ort.InferenceSession(
                str(path), options, providers=choice.names, provider_options=[o for _, o in choice.providers]
            )
        except Exception as e:  # onnxruntime raises its own exception types for broken files
            raise ModelConfigError(f"{path}: onnxruntime cannot load it on {', '.join(choice.names)}: {e}") from None
        active = self._session.get_providers()
        if choice.device == "cuda" and active[0] == CPU:
            raise ModelConfigError(
                f"{path}: onnxruntime could not open {choice.names[0]} (the CUDA libraries or the card are "
                "missing); the replica refuses to fall back to the CPU silently"
            )
        self._device = choice.device
        self._device_id = choice.device_id
        self._inputs = tuple(self._meta(x) for x in self._session.get_inputs())
        self._outputs = tuple(self._meta(x) for x in self._session.get_outputs())
        self._string_inputs = {t.name for t in self._inputs if t.datatype == "BYTES"}
        self._bind = self._device == "cuda" and not self._string_inputs
        try:
            self.couples_rows = couples_rows(path)
        except ValueError:  # onnxruntime loaded it, so it is ONNX; an odd encoding: assume the safe case
            self.couples_rows = True

    @staticmethod
    def _meta(node: Any) -> TensorMetadata:
        datatype = _ORT_TYPES.get(node.type)
        if datatype is None:
            raise ModelConfigError(f"tensor {node.name!r} has type {node.type}, which octacloud does not serve")
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
        return TensorMetadata(node.name, datatype, shape)

    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return self._outputs

    @property
    def device(self) -> str:
        return self._device

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        feed = {
            name: (np.vectorize(bytes.decode, otypes=[object])(a) if name in self._string_inputs else a)
            for name, a in inputs.items()
        }
        results = self._run_bound(feed, outputs) if self._bind else self._session.run(list(outputs), feed)
        out: dict[str, npt.NDArray[Any]] = {}
        for name, value in zip(outputs, results, strict=True):
            array = np.asarray(value)
            if array.dtype.kind in ("U", "O"):
                array = np.array([str(x).encode() for x in array.reshape(-1)], dtype=object).reshape(array.shape)
            out[name] = array
        return out

    def _run_bound(self, feed: Arrays, outputs: Sequence[str]) -> list[Any]:
        """One batch through I/O binding: host inputs bound once, outputs left on the card and copied back once."""
        binding = self._session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in outputs:
            binding.bind_output(name, "cuda", self._device_id)
        self._session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())

    def close(self) -> None:
        del self._session


class OnnxRuntimeFactory:
    """Loads ``<version>/<default_model_filename or model.onnx>`` with :class:`OnnxRuntime`, on the providers
    :func:`~octacloud.serving.providers.choose_providers` picks for its config (``available``: onnxruntime's
    providers, asked once per load when not given)."""

    platform = ONNX_PLATFORM
    backend = ONNX_BACKEND

    def __init__(self, available: Sequence[str] | None = None) -> None:
        self._available = available

    def available(self) -> Sequence[str]:
        if self._available is None:
            import onnxruntime as ort

            return list(ort.get_available_providers())
        return self._available

    def choice(self, config: ModelConfig) -> ProviderChoice:
        budget = int(os.environ.get(MEMORY_ENV, "0") or 0)
        return choose_providers(config, self.available(), visible=gpu_visible(), memory_budget=budget or None)

    def gpus(self) -> int:
        """How many GPUs a model loaded here may compute on (``serving/instances.py`` places its instances on
        them): 0 without onnxruntime's CUDA provider or on a CPU slice."""
        if CUDA not in self.available() or not gpu_visible():
            return 0
        return visible_gpu_count()

    def __call__(self, version_dir: Path, config: ModelConfig, threads: int) -> ModelRuntime:
        path = version_dir / (config.default_model_filename or "model.onnx")
        if not path.is_file():
            raise ModelConfigError(f"{path} is missing (each version folder holds the model file)")
        return OnnxRuntime(path, threads, self.choice(config))


def default_runtimes() -> dict[str, RuntimeFactory]:
    """Runtime factories by the ``backend``/``platform`` names a config may use."""
    onnx = OnnxRuntimeFactory()
    return {ONNX_BACKEND: onnx, ONNX_PLATFORM: onnx}
