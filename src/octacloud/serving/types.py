"""Protocol-agnostic inference types: tensors as numpy arrays, requests, responses and datatypes.

The datatype names are the Open Inference Protocol's (``FP32``, ``INT64``, ``BYTES``, ...). ``BYTES`` tensors are
numpy ``object`` arrays of ``bytes``, as in Triton's clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from octacloud.serving.errors import InvalidInputError

Parameters = Mapping[str, Any]

_NUMPY_OF: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_DATATYPE_OF: dict[np.dtype[Any], str] = {v: k for k, v in _NUMPY_OF.items()}
DATATYPES: frozenset[str] = frozenset(_NUMPY_OF)


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype of an OIP datatype name (``BYTES`` is ``object``)."""
    try:
        return _NUMPY_OF[datatype]
    except KeyError:
        raise InvalidInputError(
            f"unknown datatype {datatype!r}; expected one of {', '.join(sorted(DATATYPES))}"
        ) from None


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The OIP datatype name of a numpy dtype (strings and bytes are ``BYTES``)."""
    if dtype.kind in ("S", "U", "O"):
        return "BYTES"
    try:
        return _DATATYPE_OF[dtype]
    except KeyError:
        raise InvalidInputError(f"numpy dtype {dtype} has no Open Inference Protocol datatype") from None


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (0 for ``BYTES``, which has variable length)."""
    return 0 if datatype == "BYTES" else numpy_dtype(datatype).itemsize


@dataclass(slots=True)
class Tensor:
    """A named tensor. ``data`` has ``shape`` and the dtype of ``datatype``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    parameters: Parameters = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, data: npt.ArrayLike, parameters: Parameters | None = None) -> Tensor:
        """A tensor from any array-like; strings become ``BYTES``."""
        array = np.asarray(data)
        if array.dtype.kind in ("S", "U"):
            array = np.array([_to_bytes(x) for x in array.reshape(-1)], dtype=np.object_).reshape(array.shape)
        return cls(name, datatype_of(array.dtype), tuple(array.shape), array, dict(parameters or {}))


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, np.bytes_):
        return bytes(value)
    return str(value).encode()


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for (``parameters`` carry e.g. ``binary_data``)."""

    name: str
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class InferenceRequest:
    """One inference request. ``version`` "" means the model's default (latest ready) version.

    ``outputs`` empty means all outputs. ``priority`` 0 means the model's default priority level;
    ``timeout_us`` 0 means the model's default queue timeout.
    """

    model: str
    inputs: Sequence[Tensor]
    version: str = ""
    id: str = ""
    outputs: Sequence[RequestedOutput] = ()
    parameters: Parameters = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0
    tenant: str = ""
    """Who sent it, as the cloud's gateway verified it ("" when not known): a model whose rows are coupled within
    a batch batches a tenant's requests only with that tenant's (serving/model.py). Set by the protocol adapters
    from the gateway's header, never from the request's own fields."""


def scheduling_parameters(parameters: Parameters) -> tuple[int, int]:
    """(priority, timeout in µs) from a request's parameters, by Triton's names; 0 when absent."""
    values = []
    for key in ("priority", "timeout"):
        value = parameters.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInputError(f"parameter {key!r} must be a non-negative integer, got {value!r}")
        values.append(value)
    return values[0], values[1]


@dataclass(slots=True)
class InferenceResponse:
    """The result of one request, outputs in the order the model (or the request) names them."""

    model: str
    version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """An input or output as the model declares it; -1 in ``shape`` is any size (the batch dim included)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]
