"""Model storage across machines: one shared repository, a local cache on every node.

The repository lives on shared storage — a path every node mounts (NFS, a distributed file system) or an
object store reached through fsspec (``s3://bucket/models``, ``gs://...``, any URL fsspec knows; the
matching fsspec backend, e.g. ``s3fs``, must be installed on the nodes). A replica placed on a node reads its
model from that node's cache, which :meth:`ModelCache.fetch` fills on first use and refreshes when the source
changed, so a replica re-placed onto a new node starts without anyone copying models by hand.

Freshness is decided by a manifest: the relative path, size and change marker (mtime, ETag or checksum,
whichever the file system reports) of every file of the model. Equal manifests are a *hit* (nothing read
from shared storage); otherwise a *miss* copies the model into a fresh folder that replaces the cached one
atomically, under a per-model lock, so concurrent replicas on one node neither copy twice nor see a
half-written model. Hits, misses, bytes copied and time spent are counted per node
(:class:`FleetCacheStats`) and exported to Prometheus by :class:`ModelCacheCollector`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octacloud.core.errors import NotFoundError

MANIFEST = ".octacloud-manifest.json"

Manifest = dict[str, list[Any]]
"""Relative file path → [size in bytes, change marker]."""


@dataclass(frozen=True, slots=True)
class FetchResult:
    """One :meth:`ModelCache.fetch`: where the model now is locally, and what it cost."""

    path: Path
    hit: bool
    files_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0

    def describe(self, node: str) -> str:
        if self.hit:
            return f"model cache hit on {node} ({self.seconds * 1000:.0f} ms)"
        return (
            f"model cache miss on {node}: copied {self.files_copied} file(s), "
            f"{self.bytes_copied / 2**20:.1f} MiB in {self.seconds:.2f} s"
        )


@dataclass(slots=True)
class CacheStats:
    """Counts for one node's cache (or a whole fleet's, summed)."""

    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0

    def record(self, result: FetchResult) -> None:
        if result.hit:
            self.hits += 1
        else:
            self.misses += 1
        self.bytes_copied += result.bytes_copied
        self.seconds += result.seconds

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
            return {n: CacheStats(s.hits, s.misses, s.bytes_copied, s.seconds) for n, s in self.by_node.items()}


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
        }
        for name, counts in sorted(self.stats.snapshot().items()):
            for field_name, family in families.items():
                family.add_metric([name], float(getattr(counts, field_name)))
        yield from families.values()


def _filesystem(source: str) -> tuple[Any, str]:
    """The fsspec file system and root path for ``source`` (a plain path means the local file system)."""
    import fsspec

    if "://" not in source:
        source = Path(source).expanduser().resolve().as_uri()
    fs, root = fsspec.core.url_to_fs(source)
    return fs, str(root).rstrip("/")


def _marker(info: Mapping[str, Any]) -> Any:
    for key in ("ETag", "etag", "md5Hash", "md5", "mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is not None:
            return str(value)
    return None


class ModelCache:
    """A node's local copy of models from shared storage (``root``: e.g. the node's SSD)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stats = CacheStats()

    def fetch(self, source: str, model: str) -> FetchResult:
        """Make ``<source>/<model>`` available under ``root/<model>``, copying only when it changed.

        ``source`` is the repository: a path or an fsspec URL. Raises :class:`NotFoundError` when the model is
        not there. Safe to call from several processes at once on one node.
        """
        started = time.monotonic()
        fs, base = _filesystem(source)
        remote = f"{base}/{model}"
        manifest = self._manifest(fs, remote, source, model)
        self.root.mkdir(parents=True, exist_ok=True)
        local = self.root / model
        with self._locked(model):
            if _read_manifest(local) == manifest:
                result = FetchResult(local, True, seconds=time.monotonic() - started)
            else:
                files, size = self._copy(fs, remote, manifest, local)
                result = FetchResult(local, False, files, size, time.monotonic() - started)
        self.stats.record(result)
        return result

    @staticmethod
    def _manifest(fs: Any, remote: str, source: str, model: str) -> Manifest:
        if not fs.isdir(remote):
            raise NotFoundError(f"model {model!r} is not in the model storage {source}")
        found: dict[str, Mapping[str, Any]] = fs.find(remote, detail=True)
        manifest: Manifest = {}
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(path)[len(remote.rstrip("/")) :].lstrip("/")
            if not rel or rel == MANIFEST:
                continue
            manifest[rel] = [int(info.get("size") or 0), _marker(info)]
        return manifest

    def _copy(self, fs: Any, remote: str, manifest: Manifest, local: Path) -> tuple[int, int]:
        staging = self.root / f".staging-{local.name}-{uuid.uuid4().hex[:8]}"
        try:
            size = 0
            for rel, (nbytes, _) in sorted(manifest.items()):
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{remote}/{rel}", str(target))
                size += int(nbytes)
            (staging / MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
            old = self.root / f".old-{local.name}-{uuid.uuid4().hex[:8]}"
            if local.exists():
                local.rename(old)  # replicas that already loaded from it keep their open files
            staging.rename(local)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return len(manifest), size

    @contextlib.contextmanager
    def _locked(self, model: str) -> Iterator[None]:
        fd = os.open(self.root / f".{model}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read_manifest(local: Path) -> Manifest | None:
    try:
        data = json.loads((local / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if not all((local / rel).is_file() for rel in data):
        return None  # someone deleted a cached file: copy again
    return {k: list(v) for k, v in data.items()}
