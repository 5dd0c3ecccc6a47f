"""A deployment's statistics are the sum of its replicas'.

Through the gateway, ``GET /v2/models/<name>/stats`` (and gRPC ``ModelStatistics``) asks every ready replica
of the deployment and merges the answers, so clients that read server-side statistics (perf_analyzer's
"Server:" section, dashboards) see the whole deployment instead of whichever replica the request landed on.

The merge works on Triton's statistics JSON (the REST body, or the gRPC message as
``json_format.MessageToDict`` gives it, where 64-bit counters are decimal strings): entries are matched by
(name, version); counters and durations are summed, ``last_inference`` is the latest, ``batch_stats`` are
matched by ``batch_size``; text is kept from the first replica that has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

_LATEST = {"last_inference", "lastInference"}
_IDENTITY = {"name", "version", "batch_size", "batchSize"}
"""What entries are matched by, never added (a version or batch size may be a numeric string)."""
_KEYED_LISTS = {"batch_stats": "batch_size", "batchStats": "batchSize"}


def _number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _merge_value(key: str, a: Any, b: Any) -> Any:
    if key in _IDENTITY:
        return a
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        total = max(na, nb) if key in _LATEST else na + nb
        return str(total) if isinstance(a, str) else total
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return _merge_dicts(a, b)
    if isinstance(a, list) and isinstance(b, list) and key in _KEYED_LISTS:
        return _merge_keyed(a, b, _KEYED_LISTS[key])
    return a


def _merge_dicts(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge_value(key, out[key], value) if key in out else value
    return out


def _merge_keyed(a: list[Any], b: list[Any], key: str) -> list[Any]:
    merged: dict[Any, Any] = {}
    for item in [*a, *b]:
        k = str(item.get(key)) if isinstance(item, Mapping) else repr(item)
        merged[k] = _merge_dicts(merged[k], item) if k in merged else item
    return sorted(merged.values(), key=lambda item: _number(item.get(key)) or 0)


def merge_model_statistics(answers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge replicas' ``{"model_stats": [...]}`` answers into one (the key may be camelCase from gRPC)."""
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    list_key = "model_stats"
    for answer in answers:
        key = "modelStats" if "modelStats" in answer else "model_stats"
        if key in answer:
            list_key = key
        for entry in answer.get(key, []):
            ident = (str(entry.get("name", "")), str(entry.get("version", "")))
            entries[ident] = _merge_dicts(entries[ident], entry) if ident in entries else dict(entry)
    return {list_key: [entries[k] for k in sorted(entries)]}
