"""One loaded version of a model: runtime + dynamic batcher + statistics, with a ref-count so that it can be
unloaded or replaced without dropping the requests it is running."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.clock import Clock
from octacloud.serving.batching.batcher import Arrays, DynamicBatcher
from octacloud.serving.batching.handoff import BatchHandoff
from octacloud.serving.batching.policy import BatchingSettings
from octacloud.serving.classification import load_labels
from octacloud.serving.compute import ComputeProcess, compute_mode
from octacloud.serving.errors import ModelConfigError, ModelNotReadyError
from octacloud.serving.instances import PlacedRuntimes, factory_gpus, instance_plan, load_runtime, place_configs
from octacloud.serving.memory import (
    MemoryProbe,
    default_probe,
    io_bytes_per_sample,
    profile_bytes_per_sample,
    resident_bytes,
)
from octacloud.serving.repository.config import (
    PARAM_BYTES_PER_SAMPLE,
    complete_config,
    datatype_of_enum,
    int_parameter,
    io_metadata,
)
from octacloud.serving.runtime import ModelRuntime, RuntimeFactory
from octacloud.serving.stats import ModelStats
from octacloud.serving.text import TextInput
from octacloud.serving.types import numpy_dtype

PARAM_BATCH_ISOLATION = "batch_isolation"
"""Config parameter: "auto" (the default) batches a model whose graph couples rows (per-batch dynamic
quantization, serving/onnxops.py) only within one tenant (requests of unknown tenant alone) and every other
model freely; "tenants" does that for any model; "requests" never batches two requests of this model; "none"
lets a row-coupled model's requests share batches across tenants, trading isolation for throughput."""
BATCH_ISOLATION_VALUES = ("auto", "tenants", "requests", "none")
CAP_REFRESH_S = 1.0
WARMUP_MEASURE_ROWS = 8


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class InputSpec:
    """An input as the config declares it; ``shape`` includes the batch dim (-1) of a batching model."""

    name: str
    datatype: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    optional: bool


class ModelVersion:
    """A READY version serves requests; :meth:`unload` drains it first. Create with :meth:`load`."""

    def __init__(
        self,
        name: str,
        version: str,
        config: mc.ModelConfig,
        runtime: ModelRuntime,
        threads: int,
        *,
        clock: Clock | None = None,
        probe: MemoryProbe | None = None,
        instances: int | None = None,
    ) -> None:
        """``instances``: how many batches may compute at once (the instance plan's length, as
        :meth:`load` finds it for the GPUs the replica sees; default: the config's counts, on the CPU)."""
        self.name = name
        self.version = version
        self.config = config
        self.runtime = runtime
        self.state = ModelState.LOADING
        self.cold_start: dict[str, float] = {}
        """Seconds this version's start took, by part: ``load`` (the runtime), ``warmup`` (its first batches)."""
        self.stats = ModelStats()
        self.inputs, self.outputs = io_metadata(config)
        self.input_specs = {
            e.name: InputSpec(e.name, t.datatype, numpy_dtype(t.datatype), t.shape, e.optional)
            for e, t in zip(config.input, self.inputs, strict=True)
        }
        self.output_names = tuple(t.name for t in self.outputs)
        self.max_batch_size = int(config.max_batch_size)
        settings = _batching_settings(config, runtime)
        self.isolates_requests = settings.isolate_requests
        self.isolates_tenants = settings.isolate_tenants
        instances = instances or len(instance_plan(config, 0))
        self._executor = ThreadPoolExecutor(max_workers=instances, thread_name_prefix=f"model-{name}")
        self._handoff = BatchHandoff(self._executor, instances)
        self._run_async = runtime.run_async if isinstance(runtime, ComputeProcess) else None
        self._probe = probe or default_probe(runtime.device)
        self.bytes_per_sample = int_parameter(config, PARAM_BYTES_PER_SAMPLE) or 0
        self._cap_value = max(1, self.max_batch_size)
        self._cap_at = -math.inf
        self._clock = clock
        self.batcher = DynamicBatcher(
            settings,
            self._run,
            name=name,
            instances=instances,
            cap=self._cap,
            observer=self.stats,
            clock=clock,
        )
        self._inflight = 0
        self._drained: asyncio.Event | None = None
        self.text: TextInput | None = None  # raw text in (serving/text.py), set by load
        self.labels: dict[str, tuple[str, ...]] = {}  # class labels by output (serving/classification.py)

    @classmethod
    async def load(
        cls,
        name: str,
        version: str,
        version_dir: Path,
        config: mc.ModelConfig,
        factory: RuntimeFactory,
        threads: int,
        *,
        clock: Clock | None = None,
        probe: MemoryProbe | None = None,
    ) -> ModelVersion:
        """Load the runtime (in a thread), complete and check the config, warm up; READY on return."""
        began = time.monotonic()
        runtime, instances = await _start_runtime(name, version, version_dir, config, factory, threads)
        try:
            full = complete_config(
                config, runtime.inputs, runtime.outputs, platform=factory.platform, backend=factory.backend
            )
            model = cls(name, version, full, runtime, threads, clock=clock, probe=probe, instances=instances)
        except Exception:
            await asyncio.to_thread(runtime.close)  # off the loop, as in unload
            raise
        except BaseException:
            runtime.close()
            raise
        loaded = time.monotonic()
        if not model.bytes_per_sample:  # the config's parameter wins, then the toolchain's profile
            model.bytes_per_sample = profile_bytes_per_sample(version_dir) or 0
        await model._ready_up(version_dir)
        model.cold_start = {"load": loaded - began, "warmup": time.monotonic() - loaded}
        model.batcher.start()
        model.state = ModelState.READY
        return model

    async def _ready_up(self, version_dir: Path) -> None:
        """Its text input, class labels and warm-up, in a thread (a tokenizer takes 30-40 ms to load, a warm-up
        longer); on a failure the runtime is closed and the error names the version."""

        def ready_up() -> None:
            self.text = TextInput.load(version_dir, self.config)
            self.labels = load_labels(version_dir.parent, self.config)
            self._warm_up(version_dir.parent)

        try:
            await asyncio.to_thread(ready_up)
        except Exception as e:
            self._executor.shutdown(wait=False)
            await asyncio.to_thread(self.runtime.close)
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"version {self.version}: warm-up failed: {type(e).__name__}: {e}") from e

    # ---- serving -------------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Count one request in; raises :class:`ModelNotReadyError` unless READY."""
        if self.state is not ModelState.READY:
            raise ModelNotReadyError(f"model {self.name!r} version {self.version} is {self.state.value}; retry")
        self._inflight += 1

    def release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._drained is not None:
            self._drained.set()

    async def infer(
        self, inputs: Arrays, rows: int, priority: int = 0, timeout_us: int = 0, tenant: str = ""
    ) -> dict[str, npt.NDArray[Any]]:
        return await self.batcher.submit(inputs, rows, priority=priority, timeout_us=timeout_us, tenant=tenant)

    async def _run(self, inputs: Arrays) -> dict[str, npt.NDArray[Any]]:
        if self._run_async is not None:  # computed in a child process: awaited on the loop, no thread
            return await self._run_async(inputs, self.output_names)
        return await self._handoff.run(lambda: self.runtime.run(inputs, self.output_names))

    def _cap(self) -> int:
        """min(max_batch_size, floor(free memory / bytes per sample)), refreshed at most once a second."""
        if not self.bytes_per_sample:
            return max(1, self.max_batch_size)
        now = time.monotonic() if self._clock is None else self._clock.monotonic()
        if now - self._cap_at >= CAP_REFRESH_S:
            self._cap_at = now
            self._cap_value = max(1, min(self.max_batch_size, self._probe() // self.bytes_per_sample))
        return self._cap_value

    # ---- warm-up -------------------------------------------------------------------------------------------
    def _warm_up(self, model_dir: Path) -> None:
        """Run the config's ``model_warmup`` samples (or one zero batch), and measure bytes per sample."""
        batch_dims = 1 if self.max_batch_size > 0 else 0
        # every instance warms up: a compute process's run goes to every child, PlacedRuntimes.warm to every place
        run = self.runtime.warm if isinstance(self.runtime, PlacedRuntimes) else self.runtime.run
        for w in self.config.model_warmup:
            rows = max(1, w.batch_size) if batch_dims else 1
            arrays = {}
            for key, spec in w.inputs.items():
                arrays[key] = self._warmup_array(model_dir, key, spec, rows if batch_dims else 0)
            for _ in range(max(1, w.count)):
                run(arrays, self.output_names)
        if not self.config.model_warmup:
            run(self._zeros(1), self.output_names)
        if batch_dims and not self.bytes_per_sample:
            rows = min(self.max_batch_size, WARMUP_MEASURE_ROWS)
            rss = self.runtime.resident_bytes if isinstance(self.runtime, ComputeProcess) else resident_bytes
            before = rss()
            self.runtime.run(self._zeros(rows), self.output_names)
            grown = max(0, rss() - before) // rows
            self.bytes_per_sample = max(grown, io_bytes_per_sample((*self.inputs, *self.outputs), 1))

    def _zeros(self, rows: int) -> dict[str, npt.NDArray[Any]]:
        out = {}
        for spec in self.input_specs.values():
            shape = tuple(rows if i == 0 and self.max_batch_size > 0 else max(1, d) for i, d in enumerate(spec.shape))
            out[spec.name] = (
                np.full(shape, b"", dtype=object) if spec.datatype == "BYTES" else np.zeros(shape, spec.dtype)
            )
        return out

    def _warmup_array(self, model_dir: Path, key: str, spec: mc.ModelWarmup.Input, rows: int) -> npt.NDArray[Any]:
        datatype = datatype_of_enum(spec.data_type)
        shape = ((rows,) if rows else ()) + tuple(int(d) for d in spec.dims)
        dtype = numpy_dtype(datatype)
        which = spec.WhichOneof("input_data_type")
        if datatype == "BYTES":
            return np.full(shape, b"", dtype=object)
        if which == "random_data":
            return np.random.default_rng(0).random(shape).astype(dtype)
        if which == "input_data_file":
            path = model_dir / "warmup" / spec.input_data_file
            try:
                one = np.fromfile(path, dtype=dtype).reshape(shape[1:] if rows else shape)
            except (OSError, ValueError) as e:
                raise ModelConfigError(f"model_warmup input {key!r}: cannot read {path}: {e}") from None
            return np.broadcast_to(one, shape).copy() if rows else one
        return np.zeros(shape, dtype)

    # ---- unload --------------------------------------------------------------------------------------------
    async def unload(self) -> None:
        """Stop taking requests, let in-flight ones finish, then free the runtime."""
        if self.state is ModelState.UNAVAILABLE:
            return
        self.state = ModelState.UNLOADING
        if self._inflight:
            self._drained = asyncio.Event()
            await self._drained.wait()
        await self.batcher.close()
        self._executor.shutdown(wait=True)
        # freeing a model takes a while (onnxruntime: about 20 ms for ResNet-50 or BERT-base on a CPU): off the
        # loop, which goes on serving the replica's other models meanwhile
        if isinstance(self.runtime, ComputeProcess):
            await self.runtime.aclose()  # the sockets close on the loop, the children are waited for in a thread
        else:
            await asyncio.to_thread(self.runtime.close)
        self.state = ModelState.UNAVAILABLE

    @property
    def inflight(self) -> int:
        return self._inflight


def _batching_settings(config: mc.ModelConfig, runtime: ModelRuntime) -> BatchingSettings:
    """The config's batching settings, with the isolation :data:`PARAM_BATCH_ISOLATION` asks for (checked)."""
    settings = BatchingSettings.from_config(config)
    param = config.parameters.get(PARAM_BATCH_ISOLATION)
    isolation = param.string_value if param is not None and param.string_value else "auto"
    if isolation not in BATCH_ISOLATION_VALUES:
        raise ModelConfigError(
            f"parameter {PARAM_BATCH_ISOLATION!r} is {isolation!r}; choose one of {list(BATCH_ISOLATION_VALUES)}"
        )
    if isolation == "requests":
        settings = dataclasses.replace(settings, isolate_requests=True)
    elif isolation == "tenants" or (isolation == "auto" and getattr(runtime, "couples_rows", False)):
        settings = dataclasses.replace(settings, isolate_tenants=True)
    return settings


async def _start_runtime(
    name: str, version: str, version_dir: Path, config: mc.ModelConfig, factory: RuntimeFactory, threads: int
) -> tuple[ModelRuntime, int]:
    """The version's runtime, loaded in a thread (or a compute process) on the places of its instance plan, and
    how many instances it has; a runtime that cannot load it is a :class:`ModelConfigError` naming the version."""
    try:
        gpus = factory_gpus(factory)
        plan = instance_plan(config, gpus)  # one place per instance: a GPU of the slice, or the CPU
        if compute_mode(config) == "process":
            runtime: ModelRuntime = await asyncio.to_thread(
                ComputeProcess,
                factory,
                version_dir,
                config,
                max(1, threads // len(plan)),
                name,
                configs=place_configs(config, plan, gpus),
            )
        else:
            runtime = await asyncio.to_thread(load_runtime, factory, version_dir, config, threads, plan, gpus)
    except ModelConfigError:
        raise
    except Exception as e:
        raise ModelConfigError(f"version {version}: the runtime cannot load it: {type(e).__name__}: {e}") from e
    return runtime, len(plan)
