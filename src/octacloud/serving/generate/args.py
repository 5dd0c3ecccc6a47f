"""A generative model's engine arguments (``<version>/model.json``) and the memory they cost.

A generative model in the repository names its backend in ``config.pbtxt`` (``backend: "llama.cpp"``, as
Triton's ``backend: "vllm"``) and, as Triton's vLLM backend does, takes the engine's arguments from the version
folder's ``model.json``::

    {"model": "model.gguf", "context_length": 2048, "parallel": 8}

| key | default | meaning |
|---|---|---|
| ``model`` | ``model.gguf`` | the GGUF file, in the version folder |
| ``context_length`` | 2048 | tokens one sequence may hold: its prompt and its completion together |
| ``parallel`` | 4 | sequences decoded together (continuous batching); a request's ``n`` counts as ``n`` |
| ``batch_size``, ``ubatch_size`` | 512, 512 | llama.cpp's logical and physical batch (tokens per step) |
| ``cache_type_k``, ``cache_type_v`` | ``f16`` | KV cache element type (``f16``, ``bf16``, ``q8_0``, ``q4_0``...) |
| ``flash_attn`` | ``auto`` | ``on``, ``off`` or ``auto`` |
| ``gpu_layers`` | ``all`` | layers offloaded to the slice's GPU (ignored on the CPU) |
| ``cache_ram_mib`` | 0 | host memory for llama.cpp's prompt cache; counted in the replica's budget |
| ``args`` | [] | further llama-server flags, passed as they are (never those octacloud sets itself) |

The KV cache is part of the replica's memory: ``parallel × context_length`` tokens of it are allocated when the
engine starts, so the slice must hold the weights, that cache and the engine's compute buffers
(:meth:`EngineArgs.memory_bytes`). The model's shape comes from ``config.pbtxt`` parameters the toolchain
writes from the GGUF (``octacloud.llm.kv_elements_per_token``, ``octacloud.llm.context_max``,
``octacloud.llm.vocab_size``, ``octacloud.llm.embedding_length``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.repository.config import PARAM_WEIGHTS_BYTES, int_parameter

LLAMA_CPP_BACKEND = "llama.cpp"
ENGINE_ARGS_FILE = "model.json"
PARAM_KV_ELEMENTS = "octacloud.llm.kv_elements_per_token"
"""K and V elements one token adds to the cache, over every layer (``n_layer × (n_embd_k_gqa + n_embd_v_gqa)``)."""
PARAM_CONTEXT_MAX = "octacloud.llm.context_max"
"""The context the model was trained for (GGUF ``<arch>.context_length``): the most ``context_length`` may be."""
PARAM_VOCAB = "octacloud.llm.vocab_size"
PARAM_EMBEDDING = "octacloud.llm.embedding_length"

CACHE_TYPE_BITS = {
    "f32": 32.0,
    "f16": 16.0,
    "bf16": 16.0,
    "q8_0": 34 * 8 / 32,
    "q5_1": 24 * 8 / 32,
    "q5_0": 22 * 8 / 32,
    "q4_1": 20 * 8 / 32,
    "q4_0": 18 * 8 / 32,
    "iq4_nl": 18 * 8 / 32,
}
"""Bits per element of each KV cache type llama.cpp offers (its block sizes: 32 elements per block)."""
FLASH_ATTN = ("on", "off", "auto")
RESERVED_FLAGS = frozenset(
    {
        "-m", "--model", "--host", "--port", "--api-key", "--api-key-file", "-c", "--ctx-size", "-np",
        "--parallel", "-t", "--threads", "-tb", "--threads-batch", "-a", "--alias", "--metrics", "-hf",
        "--hf-repo", "-mu", "--model-url", "--webui", "--no-webui", "-kvu", "--kv-unified", "--ssl-key-file",
        "--ssl-cert-file", "--path", "--models-dir", "--offline", "-cram", "--cache-ram",
    }
)  # fmt: skip
"""Flags octacloud sets itself (where the engine listens, who may call it, what it serves, its slots and threads,
its memory) or that would make it fetch a model: refused in ``args``."""

COMPUTE_VECTORS_PER_UBATCH_TOKEN = 16
"""The engine's compute buffer, in float32 vectors of the embedding's width per token of its physical batch: an
estimate above llama.cpp's own (SmolLM2-135M at ubatch 512: 15.5 MiB measured, 18 MiB estimated)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the GGUF says about the model, as the toolchain recorded it in ``config.pbtxt``."""

    weights_bytes: int
    kv_elements_per_token: int
    context_max: int
    vocab_size: int
    embedding_length: int

    @classmethod
    def of(cls, config: mc.ModelConfig) -> ModelShape:
        values = {}
        for key in (PARAM_WEIGHTS_BYTES, PARAM_KV_ELEMENTS, PARAM_CONTEXT_MAX, PARAM_VOCAB, PARAM_EMBEDDING):
            value = int_parameter(config, key)
            if not value:
                raise ModelConfigError(
                    f"parameter {key!r} is missing from the config; publish the model with `octacloud convert "
                    "model.gguf`, which reads it from the GGUF"
                )
            values[key] = value
        return cls(*values.values())


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """``model.json``, checked (see the module docstring for each key)."""

    model: str = "model.gguf"
    context_length: int = 2048
    parallel: int = 4
    batch_size: int = 512
    ubatch_size: int = 512
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    gpu_layers: str = "all"
    cache_ram_mib: int = 0
    args: tuple[str, ...] = field(default=())

    @classmethod
    def read(cls, version_dir: Path) -> EngineArgs:
        path = version_dir / ENGINE_ARGS_FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"{path}: not a JSON object: {e}") from None
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: Any, where: str = ENGINE_ARGS_FILE) -> EngineArgs:
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{where}: the engine arguments must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ModelConfigError(f"{where}: unknown key(s) {unknown}; the keys are {sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            default = getattr(cls(), key)
            least = 0 if key == "cache_ram_mib" else 1
            if isinstance(default, int):
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ModelConfigError(f"{where}: {key!r} must be a positive integer, got {value!r}")
            elif isinstance(default, str):
                if not isinstance(value, str) or not value:
                    raise ModelConfigError(f"{where}: {key!r} must be a string, got {value!r}")
            elif not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise ModelConfigError(f"{where}: 'args' must be a list of strings, got {value!r}")
            values[key] = tuple(value) if key == "args" else value
        args = cls(**values)
        args.check(where)
        return args

    def check(self, where: str) -> None:
        if Path(self.model).name != self.model or self.model.startswith("."):
            raise ModelConfigError(f"{where}: 'model' must name a file in the version folder, got {self.model!r}")
        for key in ("cache_type_k", "cache_type_v"):
            if getattr(self, key) not in CACHE_TYPE_BITS:
                raise ModelConfigError(f"{where}: {key!r} must be one of {sorted(CACHE_TYPE_BITS)}")
        if self.flash_attn not in FLASH_ATTN:
            raise ModelConfigError(f"{where}: 'flash_attn' must be one of {list(FLASH_ATTN)}")
        if self.ubatch_size > self.batch_size:
            raise ModelConfigError(f"{where}: 'ubatch_size' ({self.ubatch_size}) exceeds 'batch_size'")
        reserved = sorted({a.split("=", 1)[0] for a in self.args} & RESERVED_FLAGS)
        if reserved:
            raise ModelConfigError(
                f"{where}: 'args' may not set {reserved}: octacloud sets them (use the keys of model.json)"
            )

    # ---- memory ------------------------------------------------------------------------------------------
    def kv_bytes_per_token(self, shape: ModelShape) -> int:
        half = shape.kv_elements_per_token / 2
        bits = half * CACHE_TYPE_BITS[self.cache_type_k] + half * CACHE_TYPE_BITS[self.cache_type_v]
        return int(bits // 8) + (1 if bits % 8 else 0)

    def kv_cache_bytes(self, shape: ModelShape) -> int:
        """The KV cache the engine allocates at start: every slot's whole context."""
        return self.parallel * self.context_length * self.kv_bytes_per_token(shape)

    def compute_bytes(self, shape: ModelShape) -> int:
        """The engine's compute buffers (an estimate; see ``COMPUTE_VECTORS_PER_UBATCH_TOKEN``) and its output
        buffer (one token's float32 logits per sequence)."""
        activations = self.ubatch_size * shape.embedding_length * 4 * COMPUTE_VECTORS_PER_UBATCH_TOKEN
        return activations + self.parallel * shape.vocab_size * 4

    def memory_bytes(self, shape: ModelShape) -> int:
        """What the replica needs: weights + KV cache for ``parallel`` sequences of ``context_length`` + compute
        buffers + the prompt cache."""
        return shape.weights_bytes + self.kv_cache_bytes(shape) + self.compute_bytes(shape) + self.cache_ram_mib * 2**20

    def describe_memory(self, shape: ModelShape) -> str:
        mib = 2**20
        return (
            f"{self.memory_bytes(shape) / mib:.0f} MiB ({shape.weights_bytes / mib:.1f} MiB weights + "
            f"{self.kv_cache_bytes(shape) / mib:.1f} MiB KV cache for {self.parallel} sequence(s) × "
            f"{self.context_length} tokens + {self.compute_bytes(shape) / mib:.1f} MiB compute"
            + (f" + {self.cache_ram_mib} MiB prompt cache" if self.cache_ram_mib else "")
            + ")"
        )

    def check_shape(self, shape: ModelShape, where: str) -> None:
        if self.context_length > shape.context_max:
            raise ModelConfigError(
                f"{where}: context_length {self.context_length} is over the {shape.context_max} tokens the model "
                "was trained for"
            )

    # ---- the command line --------------------------------------------------------------------------------
    def argv(self, model_path: Path, *, alias: str, threads: int, gpu: bool) -> list[str]:
        """llama-server's flags for these arguments (where it listens and its key are added by the caller)."""
        out = [
            "--model", str(model_path),
            "--alias", alias,
            "--parallel", str(self.parallel),
            "--ctx-size", str(self.parallel * self.context_length),
            "--no-kv-unified",
            "--batch-size", str(self.batch_size),
            "--ubatch-size", str(self.ubatch_size),
            "--cache-type-k", self.cache_type_k,
            "--cache-type-v", self.cache_type_v,
            "--flash-attn", self.flash_attn,
            "--threads", str(threads),
            "--threads-batch", str(threads),
            "--cache-ram", str(self.cache_ram_mib),
            "--metrics",
            "--no-webui",
            "--offline",
        ]  # fmt: skip
        if gpu:
            out += ["--gpu-layers", self.gpu_layers]
        return out + list(self.args)


def engine_args_for(version_dir: Path, config: mc.ModelConfig) -> tuple[EngineArgs, ModelShape]:
    """The version's engine arguments and the model's shape, checked against each other."""
    args = EngineArgs.read(version_dir)
    shape = ModelShape.of(config)
    args.check_shape(shape, str(version_dir / ENGINE_ARGS_FILE))
    if not (version_dir / args.model).is_file():
        raise ModelConfigError(f"{version_dir / args.model} is missing (model.json names it as the model file)")
    return args, shape


def is_generative(config: mc.ModelConfig) -> bool:
    return bool(config.backend == LLAMA_CPP_BACKEND)


__all__: Sequence[str] = [
    "ENGINE_ARGS_FILE",
    "LLAMA_CPP_BACKEND",
    "EngineArgs",
    "ModelShape",
    "engine_args_for",
    "is_generative",
]
