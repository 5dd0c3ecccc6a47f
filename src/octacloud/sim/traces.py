"""Readers for the openb GPU-sharing traces (Alibaba cluster-trace-gpu-v2023).

Node files have the columns ``sn,cpu_milli,memory_mib,gpu,model`` and optionally ``gpu_memory_mib`` (memory of
one card of the row, MiB) and the failure domains ``zone``, ``rack``, ``power_feed`` (written as the node's domain
labels, :mod:`octacloud.core.domains`; an empty cell declares none); pod files either
``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time`` or
only the first five (the ``multigpu`` families). ``gpu_spec`` lists allowed GPU models joined by ``|``.

Any GPU model name is accepted. A card's memory comes from the row's ``gpu_memory_mib`` column when the file has
one (and the cell is not empty), else from the per-model table ``gpu_memory`` (default :data:`GPU_MEMORY_MIB`,
a documented table; :func:`read_gpu_memory_table` reads one from a ``model,gpu_memory_mib`` file). A GPU node
whose card memory is given by neither is an error naming the model and both ways to give it. A malformed row
raises :class:`TraceFormatError` naming the file, the line, the column and the value; nothing is returned from a
file with a bad row.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from octacloud.core.domains import check_domain_name, domain_labels
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Node, Request
from octacloud.core.units import gib_to_mib

GPU_MEMORY_MIB: Mapping[str, int] = MappingProxyType(
    {
        "P100": gib_to_mib(16),
        "T4": gib_to_mib(16),
        "V100M16": gib_to_mib(16),
        "V100M32": gib_to_mib(32),
        "A10": gib_to_mib(24),
        # G2 and G3 are anonymised models in the public trace; their memory is not published. We assume
        # 16 GiB (G2, the most common, inference-class card) and 32 GiB (G3). No published policy reads card memory.
        "G2": gib_to_mib(16),
        "G3": gib_to_mib(32),
        # Common data-centre models (vendor data sheets), so that fleets of them need no table.
        "A100-40G": gib_to_mib(40),
        "A100-80G": gib_to_mib(80),
        "A100-SXM4-80GB": gib_to_mib(80),
        "A800": gib_to_mib(80),
        "H100": gib_to_mib(80),
        "H800": gib_to_mib(80),
        "H20": gib_to_mib(96),
        "L40": gib_to_mib(48),
        "L40S": gib_to_mib(48),
        "L4": gib_to_mib(24),
        "A30": gib_to_mib(24),
    }
)
"""Memory of one card per GPU model, in MiB: the openb models and common data-centre models."""

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
GPU_MEMORY_COLUMN = "gpu_memory_mib"
"""Optional node column: memory of one card of the row, in MiB (overrides the per-model table)."""
DOMAIN_COLUMNS = ("zone", "rack", "power_feed")
"""Optional node columns: the node's failure domains."""
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
"""The pod columns every openb pod file has; ``gpu_spec`` and the time columns are optional."""


class TraceFormatError(InvalidSpecError):
    """A trace file is malformed; the message names the file, line, column and value."""


@dataclass(frozen=True, slots=True)
class TracePod:
    """One pod of a trace: what it asks for and, when the trace has them, when it was created and deleted."""

    request: Request
    creation_time: int | None = None
    deletion_time: int | None = None


def read_nodes(path: str | Path, *, gpu_memory: Mapping[str, int] | None = None) -> list[Node]:
    """Read a node file. Card memory: the row's ``gpu_memory_mib`` cell if present, else ``gpu_memory[model]``
    (default :data:`GPU_MEMORY_MIB`); a GPU node with neither is a :class:`TraceFormatError`."""
    memory = GPU_MEMORY_MIB if gpu_memory is None else gpu_memory
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    for line, row, where in _rows(path, NODE_COLUMNS):
        name = row["sn"].strip()
        if not name:
            raise TraceFormatError(f"{where(line, 'sn')}: node name is empty")
        if name in seen:
            raise TraceFormatError(f"{where(line, 'sn')}: node {name!r} already defined on line {seen[name]}")
        seen[name] = line
        count = _int(row, "gpu", line, where)
        model = row["model"].strip()
        if count and not model:
            raise TraceFormatError(f"{where(line, 'model')}: a node with {count} GPUs needs a GPU model")
        card_mib = 0
        if count:
            if (row.get(GPU_MEMORY_COLUMN) or "").strip():
                card_mib = _int(row, GPU_MEMORY_COLUMN, line, where)
            elif model in memory:
                card_mib = memory[model]
            else:
                raise TraceFormatError(
                    f"{where(line, 'model')}: no card memory for GPU model {model!r}: add a {GPU_MEMORY_COLUMN!r} "
                    f"column to the node file or give a per-model table (model,{GPU_MEMORY_COLUMN}; "
                    f"`--gpu-memory FILE` or gpu_memory={{model: MiB}}); the table knows {sorted(memory)}"
                )
        try:
            gpus = tuple(Gpu(g, model, card_mib) for g in range(count))
            labels = _domain_labels(row, line, where)
            cpu, mem = _int(row, "cpu_milli", line, where), _int(row, "memory_mib", line, where)
            nodes.append(Node(name, cpu, mem, gpus, labels))
        except InvalidSpecError as exc:
            raise TraceFormatError(f"{where(line, None)}: {exc}") from None
    return nodes


def _domain_labels(row: Mapping[str, str], line: int, where: _Where) -> dict[str, str]:
    values: dict[str, str] = {}
    for column in DOMAIN_COLUMNS:
        value = (row.get(column) or "").strip()
        if value:
            try:
                values[column] = check_domain_name(column, value, where(line, column))
            except InvalidSpecError as exc:
                raise TraceFormatError(str(exc)) from None
    return domain_labels(**values)


def read_gpu_memory_table(path: str | Path) -> dict[str, int]:
    """A per-model card memory table from a ``model,gpu_memory_mib`` file, merged over :data:`GPU_MEMORY_MIB`."""
    table = dict(GPU_MEMORY_MIB)
    seen: dict[str, int] = {}
    for line, row, where in _rows(path, ("model", GPU_MEMORY_COLUMN)):
        model = row["model"].strip()
        if not model:
            raise TraceFormatError(f"{where(line, 'model')}: model name is empty")
        if model in seen:
            raise TraceFormatError(f"{where(line, 'model')}: model {model!r} already given on line {seen[model]}")
        seen[model] = line
        table[model] = _int(row, GPU_MEMORY_COLUMN, line, where)
    return table


def read_pods(path: str | Path) -> list[TracePod]:
    """Read an openb pod file (either column set). Pods keep the file's order."""
    pods: list[TracePod] = []
    seen: dict[str, int] = {}
    for line, row, where in _rows(path, POD_COLUMNS):
        name = row["name"].strip()
        if not name:
            raise TraceFormatError(f"{where(line, 'name')}: pod name is empty")
        if name in seen:
            raise TraceFormatError(f"{where(line, 'name')}: pod {name!r} already defined on line {seen[name]}")
        seen[name] = line
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(m for m in (s.strip() for s in spec.split("|")) if m)
        try:
            request = Request(
                name=name,
                num_gpu=_int(row, "num_gpu", line, where),
                gpu_milli=_int(row, "gpu_milli", line, where),
                cpu_milli=_int(row, "cpu_milli", line, where),
                memory_mib=_int(row, "memory_mib", line, where),
                gpu_models=models,
            )
        except InvalidSpecError as exc:
            if isinstance(exc, TraceFormatError):
                raise
            raise TraceFormatError(f"{where(line, None)}: {exc}") from None
        pods.append(
            TracePod(
                request,
                _optional_int(row, "creation_time", line, where),
                _optional_int(row, "deletion_time", line, where),
            )
        )
    return pods


# ---- helpers ---------------------------------------------------------------------------------------------


class _Where:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, line: int, column: str | None) -> str:
        return f"{self.path}, line {line}" + (f", column {column!r}" if column else "")


def _rows(path: str | Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str], _Where]]:
    p = Path(path)
    where = _Where(p)
    try:
        handle = p.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"{p}: cannot read the trace file ({exc.strerror or exc})") from None
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(f"{p}: the file is empty; expected a header with {', '.join(required)}")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceFormatError(f"{p}, line 1: missing column(s) {missing}; the header is {header}")
        for number, values in enumerate(reader, start=2):
            if not values or all(not v.strip() for v in values):
                continue
            if len(values) != len(header):
                raise TraceFormatError(
                    f"{p}, line {number}: expected {len(header)} values ({', '.join(header)}), got {len(values)}"
                )
            yield number, dict(zip(header, values, strict=True)), where


def _int(row: Mapping[str, str], column: str, line: int, where: _Where) -> int:
    raw = row[column].strip()
    try:
        value = int(raw)
    except ValueError:
        raise TraceFormatError(f"{where(line, column)}: expected a whole number, got {raw!r}") from None
    if value < 0:
        raise TraceFormatError(f"{where(line, column)}: must be >= 0, got {value}")
    return value


def _optional_int(row: Mapping[str, str], column: str, line: int, where: _Where) -> int | None:
    if not (row.get(column) or "").strip():
        return None
    return _int(row, column, line, where)
