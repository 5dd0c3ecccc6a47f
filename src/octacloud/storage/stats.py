"""What node caches did: per fetch (:class:`FetchResult`), per node (:class:`CacheStats`), per fleet
(:class:`FleetCacheStats`), and the Prometheus collector of it all (:class:`ModelCacheCollector`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class FetchResult:
    """One fetch: where the model now is on the node, which versions, and what it cost."""

    path: Path
    hit: bool
    files_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    versions: tuple[int, ...] = ()
    refetched: tuple[str, ...] = ()
    """Why cached files were fetched again (a file that no longer matched its SHA-256, a new build)."""
    store_error: str = ""
    """The store could not be read: the model started from the node cache alone (why it could not)."""
    evicted: int = 0
    """Versions of other models removed to make room."""

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "hit": self.hit, "files": self.files_copied, "bytes": self.bytes_copied,
                "seconds": self.seconds, "versions": list(self.versions), "refetched": list(self.refetched),
                "store_error": self.store_error, "evicted": self.evicted}  # fmt: skip

    def describe(self, node: str) -> str:
        which = f" v{','.join(map(str, self.versions))}" if self.versions else ""
        if self.hit:
            text = f"model cache hit on {node}{which} ({self.seconds * 1000:.0f} ms)"
        else:
            text = (
                f"model cache miss on {node}{which}: fetched {self.files_copied} file(s), "
                f"{self.bytes_copied / 2**20:.1f} MiB in {self.seconds:.2f} s"
            )
        if self.evicted:
            text += f"; evicted {self.evicted} version(s)"
        if self.refetched:
            text += f"; re-fetched: {'; '.join(self.refetched)}"
        if self.store_error:
            text += f"; started from the cache, the store is unavailable ({self.store_error})"
        return text


@dataclass(slots=True)
class CacheStats:
    """Counts for one node's cache (or a whole fleet's, summed)."""

    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    refetches: int = 0
    evictions: int = 0

    def record(self, result: FetchResult) -> None:
        if result.hit:
            self.hits += 1
        else:
            self.misses += 1
        self.bytes_copied += result.bytes_copied
        self.seconds += result.seconds
        self.refetches += len(result.refetched)
        self.evictions += result.evicted

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(slots=True)
class FleetCacheStats:
    """Cache outcomes per node, as the launcher saw them reported by replicas (thread-safe)."""

    by_node: dict[str, CacheStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, node: str, result: FetchResult) -> None:
        with self._lock:
            self.by_node.setdefault(node, CacheStats()).record(result)

    def snapshot(self) -> dict[str, CacheStats]:
        with self._lock:
            return {
                n: CacheStats(s.hits, s.misses, s.bytes_copied, s.seconds, s.refetches, s.evictions)
                for n, s in self.by_node.items()
            }


class ModelCacheCollector:
    """Prometheus collector of a fleet's model-cache counts (register it in the registry behind ``/metrics``)."""

    def __init__(self, stats: FleetCacheStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        node = ["node"]
        families = {
            "hits": CounterMetricFamily("octacloud_model_cache_hits", "Replica starts served from cache", labels=node),
            "misses": CounterMetricFamily(
                "octacloud_model_cache_misses", "Replica starts that copied their model from storage", labels=node
            ),
            "bytes_copied": CounterMetricFamily(
                "octacloud_model_cache_copied_bytes", "Bytes copied from storage into node caches", labels=node
            ),
            "seconds": CounterMetricFamily(
                "octacloud_model_cache_fetch_seconds", "Time replicas spent getting their model", labels=node
            ),
            "refetches": CounterMetricFamily(
                "octacloud_model_cache_refetches", "Cached files fetched again (corrupted or rebuilt)", labels=node
            ),
            "evictions": CounterMetricFamily(
                "octacloud_model_cache_evictions", "Cached versions removed to stay under the size limit", labels=node
            ),
        }
        for name, counts in sorted(self.stats.snapshot().items()):
            for field_name, family in families.items():
                family.add_metric([name], float(getattr(counts, field_name)))
        yield from families.values()
