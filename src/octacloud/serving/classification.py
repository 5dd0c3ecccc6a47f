"""Triton's classification extension: the top K classes of an output instead of its raw scores.

A client asks for it on a requested output: ``"parameters": {"classification": K}`` in REST, ``class_count``
in Triton's clients (the ``classification`` parameter, an integer, in gRPC). The output comes back as BYTES
of shape ``[batch, K']`` (``[K']`` for a model without batching), each element ``"score:index"``, or
``"score:index:label"`` when the output's config names a label file (``label_filename``, one label per line,
line *i* for class *i*, in the model folder), highest score first; K' = min(K, the number of classes). The
score is printed as Triton prints it (six decimals).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import InvalidInputError, ModelConfigError
from octacloud.serving.types import Parameters, Tensor

PARAMETER = "classification"


def class_count(output: str, parameters: Parameters) -> int | None:
    """K asked for on a requested output, or ``None``; a malformed value is an :class:`InvalidInputError`."""
    if PARAMETER not in parameters:
        return None
    value = parameters[PARAMETER]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(
            f"output {output!r}: parameter {PARAMETER!r} (class_count) must be a positive integer, got {value!r}"
        )
    if value < 1:
        raise InvalidInputError(f"output {output!r}: parameter {PARAMETER!r} (class_count) must be >= 1, got {value}")
    return value


def load_labels(model_dir: Path, config: mc.ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each output's labels from its ``label_filename``; a missing file is a :class:`ModelConfigError`."""
    labels = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        if Path(output.label_filename).is_absolute() or ".." in Path(output.label_filename).parts:
            raise ModelConfigError(
                f"output {output.name!r}: label_filename {output.label_filename!r} must name a file in {model_dir}"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"output {output.name!r}: cannot read its label file {path}: {e}") from None
        labels[output.name] = tuple(line.strip() for line in text.splitlines())
    return labels


def classify(
    name: str, scores: npt.NDArray[Any], k: int, batched: bool, labels: Mapping[str, tuple[str, ...]]
) -> Tensor:
    """The top ``k`` classes of each row of ``scores`` as a BYTES tensor named ``name``."""
    if scores.dtype.kind not in "fiub":
        raise InvalidInputError(
            f"output {name!r}: classification needs numeric scores, but the output's datatype is not numeric"
        )
    rows = scores.reshape(scores.shape[0], -1) if batched else scores.reshape(1, -1)
    if rows.shape[1] == 0:
        raise InvalidInputError(f"output {name!r} has no classes to rank (shape {list(scores.shape)})")
    k = min(k, rows.shape[1])
    names = labels.get(name, ())
    # highest first; ties keep the lower index first, as a stable sort of the negated scores does
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=object)
    for r in range(order.shape[0]):
        for c, index in enumerate(order[r]):
            label = names[index] if index < len(names) else ""
            text = f"{float(rows[r, index]):f}:{index}" + (f":{label}" if label else "")
            out[r, c] = text.encode()
    data = out if batched else out[0]
    return Tensor(name, "BYTES", tuple(data.shape), data)
