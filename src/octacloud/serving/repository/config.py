"""Triton's model configuration: parse ``config.pbtxt`` with Triton's own schema, auto-complete it from the
model, and check it against the model.

The schema is the generated ``model_config_pb2`` shipped in ``tritonclient``, so every field Triton knows parses
and an unknown field is an error that names the line. What octacloud does not implement (sequence batching,
ensembles, ``reshape``) is refused with a message rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.types import TensorMetadata

ModelConfig = mc.ModelConfig

CONFIG_FILE = "config.pbtxt"
ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
DEFAULT_MAX_BATCH_SIZE = 32
"""max_batch_size given to a model whose config is silent and whose first dims are all dynamic."""
DEFAULT_QUEUE_DELAY_US = 2000
"""The design's default: merge once the oldest request has waited 2 ms (or more than 3 wait)."""

PARAM_WEIGHTS_BYTES = "octacloud.weights_bytes"
PARAM_BYTES_PER_SAMPLE = "octacloud.bytes_per_sample"

_DATATYPE_OF_ENUM: dict[int, str] = {
    mc.TYPE_BOOL: "BOOL",
    mc.TYPE_UINT8: "UINT8",
    mc.TYPE_UINT16: "UINT16",
    mc.TYPE_UINT32: "UINT32",
    mc.TYPE_UINT64: "UINT64",
    mc.TYPE_INT8: "INT8",
    mc.TYPE_INT16: "INT16",
    mc.TYPE_INT32: "INT32",
    mc.TYPE_INT64: "INT64",
    mc.TYPE_FP16: "FP16",
    mc.TYPE_FP32: "FP32",
    mc.TYPE_FP64: "FP64",
    mc.TYPE_STRING: "BYTES",
}
_ENUM_OF_DATATYPE = {v: k for k, v in _DATATYPE_OF_ENUM.items()}


def datatype_of_enum(data_type: int) -> str:
    """``TYPE_FP32`` -> ``FP32``; ``TYPE_STRING`` -> ``BYTES``."""
    try:
        return _DATATYPE_OF_ENUM[data_type]
    except KeyError:
        raise ModelConfigError(f"data type {mc.DataType.Name(data_type)} is not supported") from None


def enum_of_datatype(datatype: str) -> int:
    return _ENUM_OF_DATATYPE[datatype]


def parse_config(text: str, where: str = CONFIG_FILE) -> mc.ModelConfig:
    """A ``ModelConfig`` from protobuf text; a syntax error or an unknown field names the line."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as e:
        raise ModelConfigError(f"{where}: {e}") from None
    return config


def read_config(model_dir: Path) -> mc.ModelConfig:
    """The model's ``config.pbtxt`` (an empty config, to be auto-completed, when there is none)."""
    path = model_dir / CONFIG_FILE
    config = parse_config(path.read_text(), str(path)) if path.is_file() else mc.ModelConfig()
    if config.name and config.name != model_dir.name:
        raise ModelConfigError(
            f"{path}: name {config.name!r} does not match the model's folder {model_dir.name!r}; "
            "rename one of them or drop 'name' from the config"
        )
    config.name = model_dir.name
    return config


def parameter(config: mc.ModelConfig, key: str) -> str | None:
    """A string parameter of the config, or None."""
    return config.parameters[key].string_value if key in config.parameters else None


def int_parameter(config: mc.ModelConfig, key: str) -> int | None:
    """An integer parameter (e.g. ``octacloud.bytes_per_sample``); a malformed one is a config error."""
    value = parameter(config, key)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ModelConfigError(f"parameter {key!r} must be an integer, got {value!r}") from None
    if number < 0:
        raise ModelConfigError(f"parameter {key!r} must be >= 0, got {number}")
    return number


def complete_config(
    config: mc.ModelConfig,
    inputs: Sequence[TensorMetadata],
    outputs: Sequence[TensorMetadata],
    *,
    platform: str,
    backend: str,
) -> mc.ModelConfig:
    """A copy of ``config`` with what it leaves out taken from the model, then checked against the model.

    ``inputs``/``outputs`` are the model's own (shapes include the batch dim, -1 where dynamic). Fills in
    platform/backend, ``max_batch_size`` (``DEFAULT_MAX_BATCH_SIZE`` when every first dim is dynamic and the
    config does not say), inputs and outputs, ``dynamic_batching`` for a batching model, one instance.
    Raises :class:`ModelConfigError` listing every problem found.
    """
    done = mc.ModelConfig()
    done.CopyFrom(config)
    problems: list[str] = []
    if done.HasField("sequence_batching") or done.HasField("ensemble_scheduling"):
        problems.append("sequence batching and ensembles are not supported by octacloud")
    if not done.platform and not done.backend:
        done.platform, done.backend = platform, backend
    elif not done.platform:
        done.platform = platform
    elif not done.backend:
        done.backend = backend
    every = [*inputs, *outputs]
    batchable = bool(every) and all(t.shape and t.shape[0] == -1 for t in every)
    if done.max_batch_size == 0 and not config.input and not config.output and batchable:
        done.max_batch_size = DEFAULT_MAX_BATCH_SIZE
    if done.max_batch_size < 0:
        problems.append(f"max_batch_size must be >= 0, got {done.max_batch_size}")
    batch_dims = 1 if done.max_batch_size > 0 else 0
    if batch_dims and not batchable:
        fixed = [t.name for t in every if not t.shape or t.shape[0] != -1]
        problems.append(
            f"max_batch_size is {done.max_batch_size} but the model's first dimension is not dynamic for "
            f"{', '.join(fixed)}; export the model with a dynamic batch dimension or set max_batch_size: 0"
        )
    problems.extend(_complete_tensors(done, inputs, outputs, batch_dims))
    problems.extend(_complete_scheduling(done))
    if problems:
        raise ModelConfigError("; ".join(problems))
    return done


def _complete_tensors(
    done: mc.ModelConfig, inputs: Sequence[TensorMetadata], outputs: Sequence[TensorMetadata], batch_dims: int
) -> list[str]:
    """Fill in the inputs and outputs ``done`` leaves out from the model's; the problems of those it declares."""
    problems: list[str] = []
    for kind, declared, actual in (("input", done.input, inputs), ("output", done.output, outputs)):
        by_name = {t.name: t for t in actual}
        if not declared:
            for t in actual:
                entry = declared.add()
                entry.name = t.name
                entry.data_type = enum_of_datatype(t.datatype)
                entry.dims.extend(t.shape[batch_dims:])
            continue
        for entry in declared:
            problems.extend(_check_tensor(kind, entry, by_name.get(entry.name), batch_dims))
            if entry.HasField("reshape"):
                problems.append(f"{kind} {entry.name!r}: 'reshape' is not supported by octacloud")
        if kind == "input":
            named = {e.name for e in declared}
            problems.extend(
                f"the model's input {t.name!r} ({t.datatype} {list(t.shape)}) is missing from the config"
                for t in actual
                if t.name not in named
            )
    return problems


def _complete_scheduling(done: mc.ModelConfig) -> list[str]:
    """Fill in dynamic batching for a batching model and one instance; the problems of batching, instance groups
    and the size parameters."""
    problems: list[str] = []
    if done.max_batch_size > 0 and not done.HasField("dynamic_batching"):
        done.dynamic_batching.max_queue_delay_microseconds = DEFAULT_QUEUE_DELAY_US
    if done.max_batch_size == 0 and done.HasField("dynamic_batching"):
        problems.append("dynamic_batching needs max_batch_size > 0")
    if done.HasField("dynamic_batching"):
        problems.extend(_check_batching(done))
    if not done.instance_group:
        done.instance_group.add(count=1)
    for group in done.instance_group:
        if group.count == 0:
            group.count = 1
        if group.count < 0:
            problems.append(f"instance_group count must be > 0, got {group.count}")
    for key in (PARAM_WEIGHTS_BYTES, PARAM_BYTES_PER_SAMPLE):
        try:
            int_parameter(done, key)
        except ModelConfigError as e:
            problems.append(str(e))
    return problems


def _check_tensor(
    kind: str, entry: mc.ModelInput | mc.ModelOutput, actual: TensorMetadata | None, batch_dims: int
) -> list[str]:
    if actual is None:
        return [f"{kind} {entry.name!r} of the config is not in the model"]
    problems = []
    datatype = _DATATYPE_OF_ENUM.get(entry.data_type)
    if datatype is None:
        problems.append(f"{kind} {entry.name!r}: data_type {mc.DataType.Name(entry.data_type)} is not supported")
    elif datatype != actual.datatype:
        problems.append(
            f"{kind} {entry.name!r}: the config says {mc.DataType.Name(entry.data_type)} "
            f"but the model has {actual.datatype}"
        )
    dims = [*([-1] * batch_dims), *entry.dims]
    if len(dims) != len(actual.shape) or any(
        d != a and d != -1 and a != -1 for d, a in zip(dims, actual.shape, strict=False)
    ):
        problems.append(
            f"{kind} {entry.name!r}: the config's dims {list(entry.dims)}"
            f"{' (after the batch dim)' if batch_dims else ''} do not match the model's shape {list(actual.shape)}"
        )
    return problems


def _check_batching(config: mc.ModelConfig) -> list[str]:
    problems = []
    db = config.dynamic_batching
    for size in db.preferred_batch_size:
        if not 0 < size <= config.max_batch_size:
            problems.append(f"preferred_batch_size {size} must be in 1..max_batch_size ({config.max_batch_size})")
    if db.priority_levels and not 0 < db.default_priority_level <= db.priority_levels:
        problems.append(
            f"default_priority_level must be in 1..priority_levels ({db.priority_levels}), "
            f"got {db.default_priority_level}"
        )
    for level in db.priority_queue_policy:
        if not 0 < level <= db.priority_levels:
            problems.append(f"priority_queue_policy for level {level}, but priority_levels is {db.priority_levels}")
    return problems


def io_metadata(config: mc.ModelConfig) -> tuple[tuple[TensorMetadata, ...], tuple[TensorMetadata, ...]]:
    """Inputs and outputs as clients see them: the batch dim (-1) first for a batching model."""
    batch = (-1,) if config.max_batch_size > 0 else ()

    def meta(entries: Sequence[mc.ModelInput] | Sequence[mc.ModelOutput]) -> tuple[TensorMetadata, ...]:
        return tuple(
            TensorMetadata(e.name, datatype_of_enum(e.data_type), (*batch, *(int(d) for d in e.dims))) for e in entries
        )

    return meta(config.input), meta(config.output)
