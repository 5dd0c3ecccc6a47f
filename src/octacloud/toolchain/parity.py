"""Parity: does a converted variant still compute what the source model computes?

Each output of a variant is compared with the source framework's output on the same sample inputs:

- ``max_abs_error``: ``max |variant − reference|``;
- ``max_rel_error``: ``max_abs_error / max |reference|`` — the error relative to the output's range (an
  element-wise ratio is meaningless for outputs near zero);
- ``min_cosine`` / ``mean_cosine``: cosine similarity per sample (the output flattened per sample);
- ``top1_agreement``: for outputs shaped ``[N, classes]``, the share of samples whose arg-max agrees.

A :class:`Tolerance` per precision decides whether a variant may be published; the report is stored beside
the model as ``parity.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.profile import PRECISIONS, Precision

PARITY_FILENAME: Final = "parity.json"


@dataclass(frozen=True, slots=True)
class Tolerance:
    """The worst a variant may be and still be published. ``None`` means "not checked"."""

    min_cosine: float
    max_rel_error: float | None = None
    min_top1_agreement: float | None = None
    """Checked only for classifiers (outputs that are class scores)."""


DEFAULT_TOLERANCES: Final[Mapping[Precision, Tolerance]] = {
    # fp32 differs from the framework only by kernel order and graph optimisation.
    "fp32": Tolerance(min_cosine=0.99999, max_rel_error=1e-3, min_top1_agreement=1.0),
    # fp16 keeps ~3 decimal digits; accumulations grow the error a little.
    "fp16": Tolerance(min_cosine=0.999, max_rel_error=2e-2, min_top1_agreement=0.9),
    # int8 is a different arithmetic: judge direction (cosine) and decisions (top-1), not digits.
    "int8": Tolerance(min_cosine=0.98, max_rel_error=None, min_top1_agreement=0.8),
}


@dataclass(frozen=True, slots=True)
class OutputParity:
    name: str
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    min_cosine: float
    mean_cosine: float
    top1_agreement: float | None


@dataclass(frozen=True, slots=True)
class ParityReport:
    """How one variant compares with the source framework, and whether that is within tolerance."""

    model: str
    precision: Precision
    reference: str
    """What the variant was compared with (``torch``, ``onnxruntime fp32 source``)."""
    samples: int
    classifier: bool
    tolerance: Tolerance
    outputs: tuple[OutputParity, ...]
    failures: tuple[str, ...]
    """Human-readable reasons the variant is outside tolerance (empty: it passed)."""
    forced: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def publishable(self) -> bool:
        return self.passed or self.forced

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "model": self.model,
            "precision": self.precision,
            "reference": self.reference,
            "samples": self.samples,
            "classifier": self.classifier,
            "passed": self.passed,
            "forced": self.forced,
            "failures": list(self.failures),
            "tolerance": asdict(self.tolerance),
            "outputs": [asdict(o) for o in self.outputs],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def compare_output(name: str, variant: np.ndarray, reference: np.ndarray, classifier: bool = False) -> OutputParity:
    """Compare one output of a variant with the reference output (same shape, batch axis first).

    Top-1 agreement is computed for a ``classifier``'s ``[N, classes]`` outputs only (it is meaningless for an
    embedding).
    """
    if variant.shape != reference.shape:
        raise ValueError(
            f"output {name!r}: the variant's shape {list(variant.shape)} differs from the "
            f"reference's {list(reference.shape)}"
        )
    a = variant.astype(np.float64).reshape(variant.shape[0], -1) if variant.ndim else variant.reshape(1, 1)
    b = reference.astype(np.float64).reshape(a.shape)
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(b).max()) if b.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(both_zero, 1.0, (a * b).sum(axis=1) / (na * nb))
    cos = np.nan_to_num(cos, nan=0.0)
    top1: float | None = None
    if classifier and variant.ndim == 2 and variant.shape[1] > 1:
        top1 = float(np.mean(variant.argmax(axis=1) == reference.argmax(axis=1)))
    return OutputParity(
        name=name,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        mean_abs_error=float(diff.mean()) if diff.size else 0.0,
        min_cosine=float(cos.min()),
        mean_cosine=float(cos.mean()),
        top1_agreement=top1,
    )


def judge(outputs: tuple[OutputParity, ...], tolerance: Tolerance, classifier: bool) -> tuple[str, ...]:
    """The reasons (if any) that ``outputs`` fall outside ``tolerance``."""
    failures: list[str] = []
    for o in outputs:
        if o.min_cosine < tolerance.min_cosine:
            failures.append(f"{o.name}: cosine similarity {o.min_cosine:.6f} < {tolerance.min_cosine}")
        if tolerance.max_rel_error is not None and o.max_rel_error > tolerance.max_rel_error:
            failures.append(f"{o.name}: relative error {o.max_rel_error:.3g} > {tolerance.max_rel_error}")
        if (
            classifier
            and tolerance.min_top1_agreement is not None
            and o.top1_agreement is not None
            and o.top1_agreement < tolerance.min_top1_agreement
        ):
            failures.append(f"{o.name}: top-1 agreement {o.top1_agreement:.3f} < {tolerance.min_top1_agreement}")
    return tuple(failures)


def compare(
    model: str,
    precision: Precision,
    variant: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    *,
    reference_name: str,
    classifier: bool,
    tolerance: Tolerance | None = None,
    forced: bool = False,
) -> ParityReport:
    """Compare every output of ``variant`` with ``reference`` and judge the result against ``tolerance``."""
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCES[precision]
    missing = sorted(set(reference) - set(variant))
    if missing:
        raise ValueError(f"{model} ({precision}): the variant lacks output(s) {missing}")
    outputs = tuple(compare_output(name, variant[name], ref, classifier) for name, ref in reference.items())
    samples = int(next(iter(reference.values())).shape[0]) if reference else 0
    return ParityReport(
        model=model,
        precision=precision,
        reference=reference_name,
        samples=samples,
        classifier=classifier,
        tolerance=tol,
        outputs=outputs,
        failures=judge(outputs, tol, classifier),
        forced=forced,
    )


def parse_tolerance(text: str, base: Mapping[Precision, Tolerance] = DEFAULT_TOLERANCES) -> tuple[Precision, Tolerance]:
    """Parse ``PRECISION:FIELD=VALUE[,FIELD=VALUE...]`` (e.g. ``int8:min_cosine=0.99,min_top1_agreement=none``)
    into that precision's tolerance, starting from ``base``. ``none`` turns an optional check off."""
    precision, sep, rest = text.partition(":")
    if precision not in PRECISIONS or not sep or not rest:
        raise InvalidSpecError(
            f"tolerance {text!r} is not PRECISION:FIELD=VALUE[,...] with PRECISION one of "
            f"{list(PRECISIONS)}, e.g. int8:min_cosine=0.99"
        )
    fields = {f.name for f in dataclasses.fields(Tolerance)}
    changes: dict[str, float | None] = {}
    for item in rest.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if key not in fields or not eq:
            raise InvalidSpecError(f"tolerance {text!r}: {key!r} is not one of {sorted(fields)} (FIELD=VALUE)")
        if value.lower() == "none" and key != "min_cosine":
            changes[key] = None
            continue
        try:
            changes[key] = float(value)
        except ValueError:
            raise InvalidSpecError(f"tolerance {text!r}: {key} must be a number, got {value!r}") from None
    return precision, dataclasses.replace(base[precision], **changes)  # type: ignore[arg-type,return-value]
