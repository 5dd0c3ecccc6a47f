"""The per-model profile: what one published model version costs and delivers on a known machine.

The scheduler turns these numbers into octants and replica counts (weights + bytes per sample × batch must fit
the slice's memory; target QPS ÷ samples/s per replica gives replicas), so this module is the contract between
the toolchain, which *measures* profiles, and the cluster and serving layers, which *read* them.

It imports the standard library and ``octacloud.core`` only — no numpy, no onnxruntime, no torch — so any
layer can read a profile without pulling in the model-building stack. A profile lives beside the model it
describes, at ``<repository>/<model>/<version>/profile.json``; :func:`read_profile` loads one.

Schema (version 1), every field required unless marked optional:

=====================  =========================================================================================
``schema_version``     ``1``
``model``              model name in the repository (``minilm_int8``)
``version``            the version directory the profile describes (``>= 1``)
``precision``          ``fp32`` | ``fp16`` | ``int8``
``weights_bytes``      bytes of the model's weights (initializers) as stored
``bytes_per_sample``   measured peak activation + input/output bytes that one more sample in a batch adds
``sample_shapes``      the per-sample shape of each input used to measure (e.g. ``{"input_ids": [128]}``)
``max_batch_size``     the largest batch the model is published for
``device``             where it was measured (``cpu``)
``execution_provider`` onnxruntime execution provider (``CPUExecutionProvider``)
``threads``            ``intra_op_num_threads`` used
``runtime``            ``onnxruntime <version>``
``measured_at``        ISO-8601 UTC time of the measurement
``batches``            one entry per batch size measured: ``batch_size``, ``p50_ms``, ``p99_ms``,
                       ``samples_per_s`` (batch_size ÷ mean latency) and ``iterations``
=====================  =========================================================================================
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

from octacloud.core.errors import InvalidSpecError

PROFILE_SCHEMA_VERSION: Final = 1
PROFILE_FILENAME: Final = "profile.json"

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: Final[tuple[Precision, ...]] = get_args(Precision)


@dataclass(frozen=True, slots=True)
class BatchMeasurement:
    """Latency and throughput of one batch size, measured back to back on an idle-as-possible machine."""

    batch_size: int
    p50_ms: float
    p99_ms: float
    samples_per_s: float
    iterations: int

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.iterations >= 1, f"batch {self.batch_size}: iterations must be >= 1, got {self.iterations}")
        for name in ("p50_ms", "p99_ms", "samples_per_s"):
            value = getattr(self, name)
            _check(
                math.isfinite(value) and value > 0,
                f"batch {self.batch_size}: {name} must be a positive number, got {value}",
            )
        _check(
            self.p99_ms >= self.p50_ms,
            f"batch {self.batch_size}: p99_ms ({self.p99_ms}) must be >= p50_ms ({self.p50_ms})",
        )


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What one published model version needs (memory) and delivers (latency, throughput) on one machine."""

    model: str
    version: int
    precision: Precision
    weights_bytes: int
    bytes_per_sample: int
    max_batch_size: int
    threads: int
    runtime: str
    measured_at: str
    batches: tuple[BatchMeasurement, ...]
    sample_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    device: str = "cpu"
    execution_provider: str = "CPUExecutionProvider"
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check(bool(self.model), "model must not be empty")
        where = f"profile of {self.model}"
        _check(
            self.schema_version == PROFILE_SCHEMA_VERSION,
            f"{where}: schema_version {self.schema_version} is not supported (expected {PROFILE_SCHEMA_VERSION})",
        )
        _check(self.version >= 1, f"{where}: version must be >= 1, got {self.version}")
        _check(self.precision in PRECISIONS, f"{where}: precision must be one of {PRECISIONS}, got {self.precision!r}")
        _check(self.weights_bytes >= 0, f"{where}: weights_bytes must be >= 0, got {self.weights_bytes}")
        _check(self.bytes_per_sample >= 0, f"{where}: bytes_per_sample must be >= 0, got {self.bytes_per_sample}")
        _check(self.max_batch_size >= 1, f"{where}: max_batch_size must be >= 1, got {self.max_batch_size}")
        _check(self.threads >= 1, f"{where}: threads must be >= 1, got {self.threads}")
        _check(bool(self.batches), f"{where}: at least one batch measurement is needed")
        sizes = [b.batch_size for b in self.batches]
        _check(sizes == sorted(set(sizes)), f"{where}: batch sizes must be distinct and increasing, got {sizes}")
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "sample_shapes", {k: tuple(v) for k, v in self.sample_shapes.items()})

    # ---- what the scheduler asks ------------------------------------------------------------------------
    def memory_bytes(self, batch_size: int) -> int:
        """Weights plus the activations of one batch: the memory a replica running ``batch_size`` needs."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.weights_bytes + batch_size * self.bytes_per_sample

    @property
    def peak(self) -> BatchMeasurement:
        """The measured batch size with the highest throughput."""
        return max(self.batches, key=lambda b: b.samples_per_s)

    def at_batch(self, batch_size: int) -> BatchMeasurement:
        """The measurement of exactly ``batch_size`` (``KeyError`` naming the measured sizes if absent)."""
        for b in self.batches:
            if b.batch_size == batch_size:
                return b
        raise KeyError(
            f"{self.model}: batch size {batch_size} was not measured (measured: {[b.batch_size for b in self.batches]})"
        )

    # ---- JSON -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "version": self.version,
            "precision": self.precision,
            "weights_bytes": self.weights_bytes,
            "bytes_per_sample": self.bytes_per_sample,
            "sample_shapes": {k: list(v) for k, v in self.sample_shapes.items()},
            "max_batch_size": self.max_batch_size,
            "device": self.device,
            "execution_provider": self.execution_provider,
            "threads": self.threads,
            "runtime": self.runtime,
            "measured_at": self.measured_at,
            "batches": [
                {
                    "batch_size": b.batch_size,
                    "p50_ms": b.p50_ms,
                    "p99_ms": b.p99_ms,
                    "samples_per_s": b.samples_per_s,
                    "iterations": b.iterations,
                }
                for b in self.batches
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        """Build a profile from parsed JSON; a missing or mistyped field raises :class:`InvalidSpecError`."""
        if not isinstance(data, Mapping):
            raise InvalidSpecError(f"a profile must be a JSON object, got {type(data).__name__}")
        try:
            raw_batches = data["batches"]
            if not isinstance(raw_batches, list):
                raise InvalidSpecError(f"profile field 'batches' must be a list, got {type(raw_batches).__name__}")
            batches = tuple(
                BatchMeasurement(
                    batch_size=_int(b, "batch_size"),
                    p50_ms=_float(b, "p50_ms"),
                    p99_ms=_float(b, "p99_ms"),
                    samples_per_s=_float(b, "samples_per_s"),
                    iterations=_int(b, "iterations"),
                )
                for b in raw_batches
            )
            shapes = data.get("sample_shapes", {})
            if not isinstance(shapes, Mapping):
                raise InvalidSpecError("profile field 'sample_shapes' must be an object of name -> [dims]")
            return cls(
                schema_version=_int(data, "schema_version"),
                model=_str(data, "model"),
                version=_int(data, "version"),
                precision=_str(data, "precision"),  # type: ignore[arg-type]  # validated in __post_init__
                weights_bytes=_int(data, "weights_bytes"),
                bytes_per_sample=_int(data, "bytes_per_sample"),
                sample_shapes={str(k): tuple(int(d) for d in v) for k, v in shapes.items()},
                max_batch_size=_int(data, "max_batch_size"),
                device=_str(data, "device"),
                execution_provider=_str(data, "execution_provider"),
                threads=_int(data, "threads"),
                runtime=_str(data, "runtime"),
                measured_at=_str(data, "measured_at"),
                batches=batches,
            )
        except KeyError as e:
            raise InvalidSpecError(f"profile is missing the field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidSpecError(f"profile is not valid JSON: {e}") from None
        return cls.from_dict(data)


def read_profile(path: str | Path) -> ModelProfile:
    """Read ``profile.json``, or the one in a version directory (``<repo>/<model>/<version>``)."""
    p = Path(path)
    if p.is_dir():
        p = p / PROFILE_FILENAME
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidSpecError(f"no profile at {p} (convert or `octacloud models build` writes one)") from None
    try:
        return ModelProfile.from_json(text)
    except InvalidSpecError as e:
        raise InvalidSpecError(f"{p}: {e}") from None


def write_profile(profile: ModelProfile, version_dir: str | Path) -> Path:
    path = Path(version_dir) / PROFILE_FILENAME
    path.write_text(profile.to_json(), encoding="utf-8")
    return path


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidSpecError(what)


def _int(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(f"profile field {key!r} must be an integer, got {value!r}")
    return value


def _float(data: Mapping[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSpecError(f"profile field {key!r} must be a number, got {value!r}")
    return float(value)


def _str(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise InvalidSpecError(f"profile field {key!r} must be a string, got {value!r}")
    return value
