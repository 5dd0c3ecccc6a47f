"""Which onnxruntime execution providers a replica uses, from the model's config and what the host has.

The rule, in order:

1. ``instance_group [ { kind: KIND_CPU } ]`` → the CPU provider only.
2. ``optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }`` → the
   TensorRT provider first (fp16 when its ``precision_mode`` parameter says ``FP16``), CUDA behind it for the
   operators TensorRT does not take, then the CPU.
3. ``KIND_GPU`` (or ``KIND_AUTO`` when the replica can see a GPU) → the CUDA provider, then the CPU.
4. Otherwise the CPU provider.

A replica "can see a GPU" when onnxruntime offers ``CUDAExecutionProvider`` *and* ``CUDA_VISIBLE_DEVICES`` is
not empty: on a CPU slice the launcher sets it to ``""`` so that a replica never computes on a card by
accident. A model that asks for what the host lacks (``KIND_GPU`` without CUDA, TensorRT without its provider)
is refused with a :class:`ModelConfigError` that names the missing provider and how to get it, never silently
run on the CPU.

The CUDA provider gets the replica's memory budget (``$OCTACLOUD_MEMORY_BYTES``, the slice's share of the card)
as ``gpu_mem_limit``, so the budget holds inside the replica even where no MPS daemon enforces it. It opens on
the GPU the config's instance group names (``gpus: [1]``), else on GPU 0; a model whose instances span several
GPUs gets one runtime per GPU, each loaded with its own group (``instances.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

GPU_INSTALL_HINT = "install octacloud's GPU set on this host (`make install` picks it where NVML finds a GPU)"
TRT_CACHE_ENV = "OCTACLOUD_TRT_CACHE"
"""Folder for TensorRT engine caches (default: ``~/.cache/octacloud/tensorrt``)."""

ProviderOptions = dict[str, str]

GPU_KINDS = (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_MODEL)
"""Instance group kinds that compute on a GPU where one is visible."""


@dataclass(frozen=True, slots=True)
class ProviderChoice:
    """The providers to open a session with, best first, and where the model computes."""

    providers: tuple[tuple[str, ProviderOptions], ...]
    device: str
    """``cuda`` when the first provider runs on a GPU, else ``cpu``."""
    device_id: int = 0
    """The GPU, as this process numbers them (``CUDA_VISIBLE_DEVICES`` renumbers a slice's cards from 0)."""

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.providers]


def gpu_visible(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``CUDA_VISIBLE_DEVICES`` is set and empty (a CPU slice); True otherwise."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    return value is None or value.strip() != ""


def visible_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs this process may use, as CUDA numbers them: the entries of ``CUDA_VISIBLE_DEVICES``, or
    every GPU NVML finds when it is unset (1 when NVML cannot be asked); 0 when it is set and empty."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return len([d for d in value.split(",") if d.strip()])
    try:
        import pynvml  # nvidia-ml-py, in the GPU install set

        pynvml.nvmlInit()
    except Exception:  # ImportError, no NVML library, no driver: CUDA finds the GPUs itself
        return 1
    try:
        return max(1, int(pynvml.nvmlDeviceGetCount()))
    except Exception:
        return 1
    finally:
        pynvml.nvmlShutdown()


def _kinds(config: mc.ModelConfig) -> set[int]:
    return {g.kind for g in config.instance_group}


def config_device(config: mc.ModelConfig) -> int:
    """The GPU a runtime loaded with ``config`` computes on: the one GPU its ``KIND_GPU``/``KIND_AUTO`` groups
    name, else 0 (a config naming several GPUs for one runtime gets the first)."""
    named = [d for g in config.instance_group if g.kind in GPU_KINDS for d in g.gpus]
    return named[0] if named else 0


def _accelerators(config: mc.ModelConfig) -> list[tuple[str, dict[str, str]]]:
    if not config.HasField("optimization"):
        return []
    accel = config.optimization.execution_accelerators
    return [(a.name.lower(), dict(a.parameters)) for a in accel.gpu_execution_accelerator]


def choose_providers(
    config: mc.ModelConfig,
    available: Sequence[str],
    *,
    visible: bool,
    memory_budget: int | None = None,
    trt_cache: Path | None = None,
) -> ProviderChoice:
    """The providers for ``config`` given onnxruntime's ``available`` providers (see the module docstring).

    ``visible``: whether this replica may use a GPU at all (:func:`gpu_visible`); ``memory_budget``: bytes the
    replica may use on its card (``gpu_mem_limit``); ``trt_cache``: where TensorRT keeps built engines.
    """
    name = config.name or "the model"
    kinds = _kinds(config)
    cuda = CUDA in available and visible
    if kinds == {mc.ModelInstanceGroup.KIND_CPU}:
        return ProviderChoice(((CPU, {}),), "cpu")
    accels = _accelerators(config)
    unknown = [a for a, _ in accels if a != "tensorrt"]
    if unknown:
        raise ModelConfigError(
            f"{name}: gpu_execution_accelerator {unknown[0]!r} is not offered (octacloud knows 'tensorrt')"
        )
    wants_gpu = mc.ModelInstanceGroup.KIND_GPU in kinds or bool(accels)
    if wants_gpu and not cuda:
        why = (
            "no GPU is visible to this replica (its slice is on a CPU card)"
            if CUDA in available
            else f"this host's onnxruntime has no {CUDA} (available: {', '.join(available) or 'none'}); "
            + GPU_INSTALL_HINT
        )
        asks = "a TensorRT accelerator" if accels else "instance_group KIND_GPU"
        raise ModelConfigError(f"{name} asks for a GPU ({asks}) but {why}")
    if not cuda:
        return ProviderChoice(((CPU, {}),), "cpu")
    device = config_device(config)  # the instance group's GPU (instances.py); CUDA_VISIBLE_DEVICES numbers from 0
    cuda_options: ProviderOptions = {
        "device_id": str(device),
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_algo_search": "HEURISTIC",
        "do_copy_in_default_stream": "1",
    }
    if memory_budget:
        cuda_options["gpu_mem_limit"] = str(memory_budget)
    chosen: list[tuple[str, ProviderOptions]] = []
    for accel, params in accels:
        if accel == "tensorrt":
            if TENSORRT not in available:
                raise ModelConfigError(
                    f"{name} asks for TensorRT (gpu_execution_accelerator 'tensorrt') but this host's onnxruntime "
                    f"has no {TENSORRT}; install TensorRT's wheels next to octacloud's GPU set, or drop the "
                    "accelerator from the config to run on CUDA"
                )
            chosen.append((TENSORRT, _trt_options(params, memory_budget, trt_cache, device)))
    chosen.append((CUDA, cuda_options))
    chosen.append((CPU, {}))
    return ProviderChoice(tuple(chosen), "cuda", device)


def _trt_options(
    params: Mapping[str, str], memory_budget: int | None, cache: Path | None, device: int = 0
) -> ProviderOptions:
    folder = cache or Path(os.environ.get(TRT_CACHE_ENV) or Path.home() / ".cache" / "octacloud" / "tensorrt")
    options: ProviderOptions = {
        "device_id": str(device),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(folder),
    }
    precision = params.get("precision_mode", "FP32").upper()
    if precision not in ("FP32", "FP16", "INT8"):
        raise ModelConfigError(f"tensorrt precision_mode must be FP32, FP16 or INT8, got {precision!r}")
    if precision == "FP16":
        options["trt_fp16_enable"] = "True"
    elif precision == "INT8":
        options["trt_int8_enable"] = "True"
    workspace = params.get("max_workspace_size_bytes")
    if workspace is not None:
        if not workspace.isdigit():
            raise ModelConfigError(f"tensorrt max_workspace_size_bytes must be an integer, got {workspace!r}")
        options["trt_max_workspace_size"] = workspace
    elif memory_budget:
        options["trt_max_workspace_size"] = str(memory_budget // 4)
    return options
