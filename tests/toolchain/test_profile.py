"""The profile schema: round trip, validation with messages that name the field, and its import weight."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.profile import BatchMeasurement, ModelProfile, read_profile, write_profile


def profile(**kw: object) -> ModelProfile:
    base: dict[str, object] = {
        "model": "m",
        "version": 3,
        "precision": "int8",
        "weights_bytes": 1000,
        "bytes_per_sample": 64,
        "max_batch_size": 16,
        "threads": 2,
        "runtime": "onnxruntime 1.32.0",
        "measured_at": "2026-01-01T00:00:00+00:00",
        "sample_shapes": {"input_ids": (128,)},
        "batches": (BatchMeasurement(1, 1.0, 2.0, 900.0, 10), BatchMeasurement(8, 4.0, 5.0, 2000.0, 10)),
    }
    base.update(kw)
    return ModelProfile(**base)  # type: ignore[arg-type]


def test_round_trips_through_json(tmp_path: Path) -> None:
    p = profile()
    write_profile(p, tmp_path)
    assert read_profile(tmp_path) == p
    assert read_profile(tmp_path / "profile.json") == p
    assert ModelProfile.from_json(p.to_json()) == p


def test_answers_the_schedulers_questions() -> None:
    p = profile()
    assert p.memory_bytes(8) == 1000 + 8 * 64
    assert p.peak.batch_size == 8
    assert p.at_batch(1).p50_ms == 1.0
    with pytest.raises(KeyError, match=r"batch size 4 was not measured \(measured: \[1, 8\]\)"):
        p.at_batch(4)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        p.memory_bytes(0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"precision": "int4"}, "precision must be one of"),
        ({"version": 0}, "version must be >= 1"),
        ({"weights_bytes": -1}, "weights_bytes must be >= 0"),
        ({"batches": ()}, "at least one batch measurement"),
        ({"batches": (BatchMeasurement(8, 1, 1, 1, 1), BatchMeasurement(1, 1, 1, 1, 1))}, "increasing"),
        ({"schema_version": 2}, "schema_version 2 is not supported"),
    ],
)
def test_invalid_profiles_are_refused_naming_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        profile(**change)


def test_a_batch_measurement_checks_its_numbers() -> None:
    with pytest.raises(InvalidSpecError, match="p99_ms .* must be >= p50_ms"):
        BatchMeasurement(1, 2.0, 1.0, 10.0, 3)
    with pytest.raises(InvalidSpecError, match="samples_per_s must be a positive number"):
        BatchMeasurement(1, 1.0, 1.0, float("nan"), 3)


def test_reading_a_broken_file_names_the_file_and_the_problem(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="no profile at"):
        read_profile(tmp_path)
    data = profile().to_dict()
    del data["weights_bytes"]
    (tmp_path / "profile.json").write_text(json.dumps(data))
    with pytest.raises(InvalidSpecError, match=r"profile.json: profile is missing the field 'weights_bytes'"):
        read_profile(tmp_path)
    data = dataclasses.replace(profile()).to_dict() | {"threads": "2"}
    (tmp_path / "profile.json").write_text(json.dumps(data))
    with pytest.raises(InvalidSpecError, match="'threads' must be an integer"):
        read_profile(tmp_path)
    (tmp_path / "profile.json").write_text("{not json")
    with pytest.raises(InvalidSpecError, match="not valid JSON"):
        read_profile(tmp_path)


def test_reading_a_profile_needs_neither_numpy_nor_torch() -> None:
    code = (
        "import sys, octacloud.toolchain.profile as p; "
        "heavy = sorted(m for m in ('numpy', 'torch', 'onnxruntime', 'transformers', 'onnx') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
