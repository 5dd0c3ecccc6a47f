"""Tensor (de)serialisation shared by REST and gRPC: Triton's raw layout for fixed-size types and its
length-prefixed layout for BYTES (each element: 4-byte little-endian length, then the bytes)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from octacloud.serving import InvalidInputError
from octacloud.serving.types import numpy_dtype

_LEN = struct.Struct("<I")


def shape_size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def from_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes | memoryview) -> npt.NDArray[Any]:
    """An array from raw bytes; the byte count must match the shape exactly."""
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"input {name!r}: shape {list(shape)} has a negative dimension")
    count = shape_size(shape)
    if datatype == "BYTES":
        return _bytes_from_raw(name, shape, count, raw)
    dtype = numpy_dtype(datatype)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInputError(
            f"input {name!r}: {len(raw)} bytes of data, but shape {list(shape)} of {datatype} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _bytes_from_raw(name: str, shape: tuple[int, ...], count: int, raw: bytes | memoryview) -> npt.NDArray[Any]:
    view = memoryview(raw)
    items: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidInputError(f"input {name!r}: BYTES data is truncated inside a length prefix")
        (n,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + n > len(view):
            raise InvalidInputError(f"input {name!r}: BYTES element {len(items)} is truncated")
        items.append(bytes(view[offset : offset + n]))
        offset += n
    if len(items) != count:
        raise InvalidInputError(f"input {name!r}: {len(items)} BYTES elements, but shape {list(shape)} needs {count}")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array.reshape(shape)


def to_raw(array: npt.NDArray[Any]) -> bytes:
    """Raw bytes of an array (BYTES arrays length-prefixed)."""
    if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
        parts = []
        for x in array.reshape(-1):
            b = x if isinstance(x, bytes) else str(x).encode()
            parts.append(_LEN.pack(len(b)))
            parts.append(b)
        return b"".join(parts)
    return np.ascontiguousarray(array).tobytes()


def from_list(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> npt.NDArray[Any]:
    """An array from JSON data (flat or nested); BYTES elements are strings."""
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"input {name!r}: shape {list(shape)} has a negative dimension")
    dtype = numpy_dtype(datatype)
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=object).reshape(-1)
            array = np.empty(flat.size, dtype=object)
            if not all(isinstance(x, str) for x in flat):
                raise InvalidInputError(f"input {name!r}: BYTES data in JSON must be strings")
            array[:] = [x.encode() for x in flat]
        else:
            array = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise InvalidInputError(f"input {name!r}: data is not {datatype}: {e}") from None
    if array.size != shape_size(shape):
        raise InvalidInputError(
            f"input {name!r}: {array.size} values, but shape {list(shape)} needs {shape_size(shape)}"
        )
    return array.reshape(shape)


def to_list(array: npt.NDArray[Any]) -> list[Any]:
    """Flat JSON-able data (BYTES as strings)."""
    flat = array.reshape(-1)
    if array.dtype == np.object_:
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in flat]
    values: list[Any] = flat.tolist()
    return values
