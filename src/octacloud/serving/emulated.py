"""An emulated runtime: a model that answers after a configurable latency and computes nothing.

What an emulated fleet runs (``octacloud up --emulate``, :mod:`octacloud.control.emulated`): every replica is a
real OIP server (REST, gRPC, metrics, health, the internal secret) over the real DataPlane and batcher, but its
runtime only sleeps ``latency_s + per_row_s × rows`` in the model's worker thread, as a card would be busy, and
returns zeros of the shapes the model's ``config.pbtxt`` declares. So the control plane, the gateway and the
meter are measured at the size of a real fleet on a machine that could never hold its models.

The config must declare its inputs and outputs (the example models do): an emulated replica never opens the
model file, so it cannot complete a config from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.repository.config import ONNX_BACKEND, ONNX_PLATFORM, ModelConfig, datatype_of_enum
from octacloud.serving.runtime import Arrays, RuntimeFactory
from octacloud.serving.types import TensorMetadata, numpy_dtype

EMULATED_BACKENDS = (ONNX_BACKEND, ONNX_PLATFORM, "fake")
"""The backends and platforms an emulated replica answers for (each by the same emulated runtime)."""


@dataclass(frozen=True, slots=True)
class EmulatedLatency:
    """How long an emulated batch takes: ``fixed_ms`` plus ``per_row_ms`` per row of the batch."""

    fixed_ms: float = 2.0
    per_row_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_row_ms"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"emulated latency {name} must be a number ≥ 0, got {value!r}")

    def seconds(self, rows: int) -> float:
        return (self.fixed_ms + self.per_row_ms * rows) / 1000


class EmulatedRuntime:
    """Sleeps for its latency, then answers zeros (empty strings for BYTES) of the declared output shapes."""

    def __init__(
        self, inputs: Sequence[TensorMetadata], outputs: Sequence[TensorMetadata], latency: EmulatedLatency
    ) -> None:
        self._inputs = tuple(inputs)
        self._outputs = {o.name: o for o in outputs}
        self.latency = latency
        self.batches = 0

    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return tuple(self._outputs.values())

    @property
    def device(self) -> str:
        return "emulated"

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        first = next(iter(inputs.values()), None)
        batched = bool(self._inputs) and self._inputs[0].shape[:1] == (-1,)
        rows = int(first.shape[0]) if first is not None and first.ndim and batched else 1
        self.batches += 1
        pause = self.latency.seconds(rows)
        if pause:
            time.sleep(pause)
        return {name: _zeros(self._outputs[name], rows if batched else None) for name in outputs}

    def close(self) -> None:
        pass


def _zeros(meta: TensorMetadata, rows: int | None) -> npt.NDArray[Any]:
    dims = list(meta.shape)
    if rows is not None:
        dims = [rows, *dims[1:]]
    shape = tuple(1 if d < 0 else d for d in dims)
    if meta.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, numpy_dtype(meta.datatype))


class EmulatedRuntimeFactory:
    """Builds an :class:`EmulatedRuntime` from a config that declares its inputs and outputs."""

    platform = ONNX_PLATFORM
    backend = ONNX_BACKEND

    def __init__(self, latency: EmulatedLatency | None = None) -> None:
        self.latency = latency or EmulatedLatency()

    def __call__(self, version_dir: Path, config: ModelConfig, threads: int) -> EmulatedRuntime:
        if not version_dir.is_dir():
            raise ModelConfigError(f"{version_dir} is missing")
        if not config.input or not config.output:
            raise ModelConfigError(
                f"model {config.name!r}: an emulated replica needs the inputs and outputs declared in its "
                "config.pbtxt (it never opens the model file to read them)"
            )
        batch = (-1,) if config.max_batch_size > 0 else ()

        def meta(entries: Any) -> list[TensorMetadata]:
            return [TensorMetadata(e.name, datatype_of_enum(e.data_type), (*batch, *map(int, e.dims))) for e in entries]

        return EmulatedRuntime(meta(config.input), meta(config.output), self.latency)


def emulated_runtimes(latency: EmulatedLatency | None = None) -> dict[str, RuntimeFactory]:
    """The runtime table of an emulated replica: every backend it answers for, emulated."""
    factory = EmulatedRuntimeFactory(latency)
    return dict.fromkeys(EMULATED_BACKENDS, factory)
