"""Tensor signatures of a model, and the sample inputs that exercise it.

A :class:`TensorSpec` is one input or output: its name, numpy dtype and shape with the batch axis first.
``None`` marks a dynamic axis (the batch axis is always dynamic; a text model's sequence axis usually is).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from octacloud.core.errors import InvalidSpecError

# numpy dtype name -> (ONNX TensorProto elem type, Triton DataType name)
_DTYPES: Final[dict[str, tuple[int, str]]] = {
    "float32": (1, "TYPE_FP32"),
    "uint8": (2, "TYPE_UINT8"),
    "int8": (3, "TYPE_INT8"),
    "uint16": (4, "TYPE_UINT16"),
    "int16": (5, "TYPE_INT16"),
    "int32": (6, "TYPE_INT32"),
    "int64": (7, "TYPE_INT64"),
    "bool": (9, "TYPE_BOOL"),
    "float16": (10, "TYPE_FP16"),
    "float64": (11, "TYPE_FP64"),
    "uint32": (12, "TYPE_UINT32"),
    "uint64": (13, "TYPE_UINT64"),
}
_BY_ONNX: Final = {onnx_type: name for name, (onnx_type, _) in _DTYPES.items()}

DEFAULT_DYNAMIC_SIZE: Final = 16
"""Size given to a dynamic non-batch axis (a sequence) when sample inputs are made without a hint."""


def dtype_from_onnx(elem_type: int) -> str:
    try:
        return _BY_ONNX[elem_type]
    except KeyError:
        raise InvalidSpecError(f"ONNX element type {elem_type} is not supported by octacloud") from None


def onnx_elem_type(dtype: str) -> int:
    return _DTYPES[dtype][0]


def triton_type(dtype: str) -> str:
    return _DTYPES[dtype][1]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output of a model. ``shape[0]`` is the batch axis; ``None`` is a dynamic axis."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    low: int = 0
    """For integer inputs: sample values are drawn from ``[low, high)`` (token ids: ``[0, vocab)``)."""
    high: int = 2

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidSpecError("a tensor needs a name")
        if self.dtype not in _DTYPES:
            raise InvalidSpecError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if not self.shape:
            raise InvalidSpecError(f"tensor {self.name!r}: needs at least the batch axis")
        if any(d is not None and d < 1 for d in self.shape):
            raise InvalidSpecError(f"tensor {self.name!r}: dimensions must be >= 1 or dynamic, got {self.shape}")

    @property
    def sample_dims(self) -> tuple[int | None, ...]:
        """The shape of one sample (without the batch axis): what ``config.pbtxt`` calls ``dims``."""
        return self.shape[1:]

    def describe(self) -> str:
        dims = ",".join("N" if i == 0 else ("?" if d is None else str(d)) for i, d in enumerate(self.shape))
        return f"{self.name}: {self.dtype}[{dims}]"

    def concrete_sample_shape(self, hints: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """One sample's shape with dynamic axes fixed to ``hints[name]`` or :data:`DEFAULT_DYNAMIC_SIZE`."""
        size = (hints or {}).get(self.name, DEFAULT_DYNAMIC_SIZE)
        return tuple(size if d is None else d for d in self.sample_dims)


_SPEC_RE: Final = re.compile(r"^(?P<name>[A-Za-z_][\w.\-]*):(?P<dtype>\w+):(?P<shape>-?\d+(,-?\d+)*)$")


def parse_input_spec(text: str) -> TensorSpec:
    """Parse ``NAME:DTYPE:SHAPE`` as given on the command line, e.g. ``input:float32:-1,256``.

    The first axis must be ``-1`` (the dynamic batch axis); other ``-1`` axes are dynamic too.
    """
    m = _SPEC_RE.match(text.strip())
    if m is None:
        raise InvalidSpecError(f"input spec {text!r} is not NAME:DTYPE:SHAPE (e.g. input:float32:-1,3,224,224)")
    dims = [int(d) for d in m["shape"].split(",")]
    if dims[0] != -1:
        raise InvalidSpecError(f"input spec {text!r}: the first axis is the batch axis and must be -1")
    if any(d == 0 or d < -1 for d in dims):
        raise InvalidSpecError(f"input spec {text!r}: dimensions must be positive or -1 (dynamic)")
    return TensorSpec(m["name"], m["dtype"], tuple(None if d == -1 else d for d in dims))


def make_samples(
    specs: Sequence[TensorSpec], batch: int, rng: np.random.Generator, hints: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Random inputs for ``specs``: normal floats, integers in ``[low, high)``; ``*mask*`` inputs are all ones.

    Inputs that share a dynamic axis size hint (e.g. a text model's ``input_ids`` and ``attention_mask``)
    get the same shape, so they stay consistent with each other.
    """
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = (batch, *spec.concrete_sample_shape(hints))
        if spec.dtype in ("float32", "float16", "float64"):
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype == "bool":
            out[spec.name] = np.ones(shape, dtype=bool)
        elif "mask" in spec.name:
            out[spec.name] = np.ones(shape, dtype=spec.dtype)
        else:
            out[spec.name] = rng.integers(spec.low, spec.high, size=shape).astype(spec.dtype)
    return out


def check_batch(specs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray], what: str) -> int:
    """Check that ``arrays`` holds one array per spec with a matching dtype kind and shape; return the batch.

    Raises :class:`InvalidSpecError` naming the input, the expected signature and what was found.
    """
    names = {s.name for s in specs}
    missing = sorted(names - set(arrays))
    if missing:
        raise InvalidSpecError(
            f"{what}: missing input(s) {missing}; the model expects "
            f"{[s.describe() for s in specs]}, got arrays {sorted(arrays)}"
        )
    extra = sorted(set(arrays) - names)
    if extra:
        raise InvalidSpecError(f"{what}: unknown input(s) {extra}; the model's inputs are {sorted(names)}")
    batch: int | None = None
    for spec in specs:
        arr = arrays[spec.name]
        ok_rank = arr.ndim == len(spec.shape)
        ok_dims = ok_rank and all(d is None or d == a for d, a in zip(spec.shape[1:], arr.shape[1:], strict=True))
        if not ok_dims:
            raise InvalidSpecError(
                f"{what}: input {spec.name!r} has shape {list(arr.shape)} but the model "
                f"expects {spec.describe()} (N: any batch, ?: any size)"
            )
        expected_kind = np.dtype(spec.dtype).kind
        if arr.dtype.kind != expected_kind and not (expected_kind in "iu" and arr.dtype.kind in "iu"):
            raise InvalidSpecError(
                f"{what}: input {spec.name!r} has dtype {arr.dtype} but the model expects {spec.dtype}"
            )
        if batch is None:
            batch = int(arr.shape[0])
        elif arr.shape[0] != batch:
            raise InvalidSpecError(
                f"{what}: inputs disagree on the batch size ({spec.name!r} has {arr.shape[0]}, others {batch})"
            )
    if not batch:
        raise InvalidSpecError(f"{what}: holds no samples")
    return batch
