"""Input signatures from the command line, and batches checked against them."""

from __future__ import annotations

import numpy as np
import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.spec import TensorSpec, check_batch, make_samples, parse_input_spec


def test_parses_name_dtype_and_shape_with_dynamic_axes() -> None:
    spec = parse_input_spec("input_ids:int64:-1,-1")
    assert spec == TensorSpec("input_ids", "int64", (None, None))
    assert parse_input_spec("x:float32:-1,3,224,224").sample_dims == (3, 224, 224)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x:float32:1,256", "batch axis and must be -1"),
        ("x:float32", "is not NAME:DTYPE:SHAPE"),
        ("x:complex64:-1,4", "dtype 'complex64' is not one of"),
        ("x:float32:-1,0", "must be positive or -1"),
    ],
)
def test_bad_specs_say_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_input_spec(text)


def test_samples_follow_the_spec_and_masks_are_ones() -> None:
    specs = [
        TensorSpec("input_ids", "int64", (None, None), low=5, high=9),
        TensorSpec("attention_mask", "int64", (None, None)),
    ]
    s = make_samples(specs, 3, np.random.default_rng(0), {"input_ids": 7, "attention_mask": 7})
    assert s["input_ids"].shape == (3, 7) and s["input_ids"].min() >= 5 and s["input_ids"].max() < 9
    assert (s["attention_mask"] == 1).all()


def test_check_batch_reports_the_mismatch() -> None:
    specs = [TensorSpec("pixel_values", "float32", (None, 3, 8, 8))]
    assert check_batch(specs, {"pixel_values": np.zeros((5, 3, 8, 8), np.float32)}, "cal") == 5
    with pytest.raises(InvalidSpecError, match=r"'pixel_values' has shape \[5, 3, 4, 4\] but the model expects"):
        check_batch(specs, {"pixel_values": np.zeros((5, 3, 4, 4), np.float32)}, "cal")
    with pytest.raises(InvalidSpecError, match=r"missing input\(s\) \['pixel_values'\]"):
        check_batch(specs, {"image": np.zeros((5, 3, 8, 8), np.float32)}, "cal")
    with pytest.raises(InvalidSpecError, match="has dtype int64 but the model expects float32"):
        check_batch(specs, {"pixel_values": np.zeros((5, 3, 8, 8), np.int64)}, "cal")
    with pytest.raises(InvalidSpecError, match="holds no samples"):
        check_batch(specs, {"pixel_values": np.zeros((0, 3, 8, 8), np.float32)}, "cal")
