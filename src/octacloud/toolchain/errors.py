"""Errors of the toolchain. Each says what was wrong and what to do; none leaves the repository changed."""

from __future__ import annotations

from octacloud.core.errors import InvalidSpecError, OctacloudError


class ConversionError(OctacloudError):
    """A model could not be exported, converted or run (e.g. an operator without an ONNX translation)."""


class SourceError(InvalidSpecError):
    """The source model is missing, unreadable, or not a kind the toolchain knows."""


class CalibrationError(InvalidSpecError):
    """The calibration set does not match the model's inputs (names, shapes, dtypes)."""
