"""Parity metrics and the tolerance gate, on arrays whose answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.parity import DEFAULT_TOLERANCES, Tolerance, compare, compare_output, parse_tolerance


def test_identical_outputs_are_perfect() -> None:
    x = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    o = compare_output("y", x.copy(), x, classifier=True)
    assert (o.max_abs_error, o.max_rel_error, o.top1_agreement) == (0.0, 0.0, 1.0)
    assert o.min_cosine == pytest.approx(1.0)


def test_errors_are_measured_against_the_outputs_range() -> None:
    ref = np.array([[10.0, 0.0, -5.0], [1.0, 2.0, 3.0]])
    got = ref + np.array([[0.5, 0.0, 0.0], [0.0, 0.0, -0.1]])
    o = compare_output("y", got, ref)
    assert o.max_abs_error == pytest.approx(0.5)
    assert o.max_rel_error == pytest.approx(0.05)  # 0.5 / max|ref| = 10
    assert o.top1_agreement is None  # not a classifier: arg-max means nothing


def test_top1_agreement_and_cosine_for_a_classifier() -> None:
    ref = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    got = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])  # one flipped: orthogonal
    o = compare_output("logits", got, ref, classifier=True)
    assert o.top1_agreement == 0.75
    assert o.min_cosine == pytest.approx(0.0)
    assert o.mean_cosine == pytest.approx(0.75)


def test_zero_rows_count_as_equal_and_shape_mismatch_is_refused() -> None:
    z = np.zeros((2, 3))
    assert compare_output("y", z, z).min_cosine == 1.0
    with pytest.raises(ValueError, match=r"shape \[2, 4\] differs from the reference's \[2, 3\]"):
        compare_output("y", np.zeros((2, 4)), z)


def test_the_gate_names_every_failure_and_force_publishes_anyway() -> None:
    ref = {"logits": np.array([[1.0, 0.0], [0.0, 1.0]])}
    bad = {"logits": np.array([[0.0, 1.0], [0.0, 1.0]])}
    strict = Tolerance(min_cosine=0.99, max_rel_error=0.1, min_top1_agreement=1.0)
    report = compare("m_int8", "int8", bad, ref, reference_name="torch", classifier=True, tolerance=strict)
    assert not report.passed and not report.publishable
    assert len(report.failures) == 3
    assert "cosine similarity" in report.failures[0] and "top-1 agreement 0.500" in report.failures[2]
    forced = compare("m_int8", "int8", bad, ref, reference_name="torch", classifier=True, tolerance=strict, forced=True)
    assert forced.publishable and not forced.passed
    stored = json.loads(forced.to_json())
    assert stored["forced"] is True and stored["passed"] is False and stored["tolerance"]["min_cosine"] == 0.99


def test_defaults_get_looser_with_lower_precision() -> None:
    fp32, fp16, int8 = (DEFAULT_TOLERANCES[p] for p in ("fp32", "fp16", "int8"))
    assert fp32.min_cosine > fp16.min_cosine > int8.min_cosine


def test_tolerances_can_be_overridden_from_text() -> None:
    precision, tol = parse_tolerance("int8:min_cosine=0.995,min_top1_agreement=none")
    assert precision == "int8"
    assert tol == Tolerance(min_cosine=0.995, max_rel_error=None, min_top1_agreement=None)
    assert parse_tolerance("fp16:max_rel_error=0.5")[1].min_cosine == DEFAULT_TOLERANCES["fp16"].min_cosine


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int4:min_cosine=1", "PRECISION one of"),
        ("int8", "PRECISION:FIELD=VALUE"),
        ("int8:cosine=0.9", "'cosine' is not one of"),
        ("int8:min_cosine=high", "must be a number"),
        ("int8:min_cosine=none", "must be a number"),
    ],
)
def test_bad_tolerance_text_says_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_tolerance(text)
