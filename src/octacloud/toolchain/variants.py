"""Precision variants of an fp32 ONNX graph: fp16 and int8.

- **fp16**: weights and activations in half precision, inputs and outputs kept in their original types (the
  wire format does not change), numerically sensitive ops left in fp32 by onnxruntime's converter's block list.
- **int8, dynamic**: weights quantized per channel ahead of time, activations quantized on the fly
  (``quantize_dynamic``): no calibration needed; the right default for transformers and MLPs. Its per-tensor
  activation scales are then made per row (:mod:`.rowscales`), so that a request's result does not depend on
  the other requests of its batch.
- **int8, static**: weights and activations quantized ahead of time in QDQ form, with activation ranges
  calibrated on a user's sample set (``quantize_static``); the right choice for CNNs, whose convolutions
  onnxruntime only accelerates in this form.

Both quantize weights to 7 bits (``reduce_range``), so that an int8 model computes the same numbers on every
x86-64 CPU. onnxruntime multiplies uint8 activations by int8 weights with ``vpmaddubsw`` on CPUs without
VNNI (AVX2 only, e.g. before Intel Cascade Lake or AMD Zen 4): it adds two uint8×int8 products into a
saturating int16, which full-range weights overflow (255·127·2 > 32767), and the result is garbage (the
test MLP's minimum cosine 0.24 instead of 0.9996). VNNI CPUs accumulate in int32 and never saturate, so a
model quantized and checked on one would pass parity there and fail on an older serving node. 7-bit
weights cannot overflow, and give bit-identical outputs on both kinds of CPU at the cost of one bit of
weight precision (the test MLP: 0.99926 instead of 0.99959).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.errors import CalibrationError, ConversionError
from octacloud.toolchain.rowscales import RowScaleRewrite, per_row_activation_scales
from octacloud.toolchain.spec import TensorSpec, check_batch

REDUCE_RANGE = True
"""7-bit weights: int8 models give the same results on CPUs with and without VNNI (module docstring)."""


def to_fp16(src: Path, dst: Path) -> None:
    model = onnx.load(str(src))
    try:
        half = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    except Exception as e:
        raise ConversionError(f"fp16 conversion of {src.name} failed: {e}") from None
    onnx.save(half, str(dst))


def without_initializer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the ``value_info`` entries that only restate an initializer's own shape.

    PyTorch's exporter writes them; onnxruntime's quantizer before 1.32 turns a ``Gemm``'s transposed weight
    into a ``MatMul`` weight by transposing the initializer in place under the same name, leaving the stale
    entry behind, and its shape inference then fails ("Inferred shape and existing shape differ in dimension
    0: (16) vs (32)"). The entries carry nothing the initializers do not, so dropping them loses nothing.
    """
    names = {t.name for t in model.graph.initializer}
    kept = [v for v in model.graph.value_info if v.name not in names]
    if len(kept) < len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return model


def to_int8_dynamic(src: Path, dst: Path) -> RowScaleRewrite:
    """Quantize dynamically, then give every activation per-row scales where the graph allows it (returned:
    what was rewritten and what kept its per-tensor scale, which serving then never batches with others)."""
    with _quiet_quantizer():
        try:
            quantize_dynamic(
                without_initializer_shapes(onnx.load(str(src))),
                str(dst),
                weight_type=QuantType.QInt8,
                per_channel=True,
                reduce_range=REDUCE_RANGE,
            )
        except Exception as e:
            raise ConversionError(f"int8 dynamic quantization of {src.name} failed: {e}") from None
    model = onnx.load(str(dst))
    rewrite = per_row_activation_scales(model)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ConversionError(f"per-row activation scales for {src.name} gave an invalid graph: {e}") from None
    onnx.save(model, str(dst))
    return rewrite


class CalibrationSet(CalibrationDataReader):  # type: ignore[misc]  # onnxruntime is untyped
    """Calibration samples fed one at a time (batch 1) to the calibrator.

    ``arrays`` maps each model input to an array whose first axis indexes samples; it is checked against the
    model's inputs on construction, so a mismatch is reported before any work is done.
    """

    def __init__(self, inputs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray], source: str) -> None:
        try:
            self.size = check_batch(inputs, arrays, f"calibration set {source}")
        except InvalidSpecError as e:
            raise CalibrationError(str(e)) from None
        self._arrays = {s.name: np.asarray(arrays[s.name]).astype(s.dtype, copy=False) for s in inputs}
        self._iter: Iterator[dict[str, np.ndarray]] = self._samples()

    def _samples(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(self.size):
            yield {name: a[i : i + 1] for name, a in self._arrays.items()}

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def rewind(self) -> None:
        self._iter = self._samples()


def load_arrays(path: Path, what: str) -> dict[str, np.ndarray]:
    """Arrays by input name from an ``.npz`` file (samples on axis 0); :class:`CalibrationError` if unreadable."""
    if not path.is_file():
        raise CalibrationError(f"{what} {path} does not exist (expected an .npz with one array per model input)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception as e:
        raise CalibrationError(f"{what} {path} is not a readable .npz file: {e}") from None


def load_calibration(path: Path, inputs: Sequence[TensorSpec]) -> CalibrationSet:
    """Read a calibration set from an ``.npz`` file with one array per model input (samples on axis 0)."""
    return CalibrationSet(inputs, load_arrays(path, "calibration set"), str(path))


def to_int8_static(src: Path, dst: Path, calibration: CalibrationSet, workdir: Path) -> None:
    prepared = workdir / f"{src.stem}.preprocessed.onnx"
    with _quiet_quantizer():
        try:
            quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
            calibration.rewind()
            quantize_static(
                str(prepared),
                str(dst),
                calibration,
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                reduce_range=REDUCE_RANGE,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
            )
        except Exception as e:
            raise ConversionError(f"int8 static quantization of {src.name} failed: {e}") from None


class _quiet_quantizer:  # a context manager used like a function
    """The quantizer logs advice ("consider pre-processing") on the root logger; keep the CLI's output clean."""

    def __enter__(self) -> None:
        self._level = logging.root.level
        logging.root.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        logging.root.setLevel(self._level)
