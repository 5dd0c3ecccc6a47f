"""A node's model cache: the versions its replicas need, copied from the model store onto local disk, checked.

Layout under ``root`` (the node's SSD)::

    <model>/config.pbtxt                the model's config as last read from the store
    <model>/<version>/...               one *entry*: a version's files, complete and verified
    <model>/<version>/.octacloud-entry.json    what was fetched: size and SHA-256 per file, the store's fingerprint
    .locks/  .staging/  .leases/  .reservations/  .trash/

**Only what is needed.** :meth:`NodeCache.fetch` takes the versions a replica serves (the caller resolves the
model's version policy), never the whole model.

**One download per node.** Each entry has a ``flock``: however many replicas, threads or processes ask for a
version at once, one downloads it and the others wait, then hit. Files are downloaded in parallel, large ones
in ranges (``parallel`` requests of ``chunk_bytes``), into a staging folder that is renamed into place only
once every file matches its manifest: a download killed half-way (``kill -9``) leaves only a staging folder,
which the next fetch of that version removes; nothing half-written is ever served.

**Integrity.** A hit re-checks every cached file's size and SHA-256 against what was fetched, and the entry
against the store's manifest when the store answers: a file damaged on the node's disk, or a version rebuilt
in the store, is fetched again (``FetchResult.refetched`` says why), never served.

**A size limit.** With ``limit_bytes``, room for a new entry is made by evicting the least recently used
entries first — files and all — but never one that a live replica holds a lease on, nor one being fetched.
When the entries in use leave no room, the fetch fails with :class:`CacheFullError` saying so.

**The store away.** When the store cannot be read, versions already cached are served from the cache (the
result's ``store_error`` says why the store was not asked); anything else fails with the store's error, and
nothing cached is removed. The next fetch once the store answers again catches up (new builds, new versions).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from octacloud.core.errors import NotFoundError, OctacloudError
from octacloud.storage.leases import Leases, entry_key, locked
from octacloud.storage.manifest import FileDigest, Manifest, mismatches, sha256_of
from octacloud.storage.stats import CacheStats, FetchResult, FleetCacheStats, ModelCacheCollector
from octacloud.storage.store import CONFIG_FILE, MANIFEST_FILE, ModelStore, StoreUnavailableError

__all__ = ["CacheFullError", "FetchResult", "FleetCacheStats", "ModelCacheCollector", "NodeCache"]

ENTRY_FILE = ".octacloud-entry.json"
CHUNK_BYTES = 8 * 2**20
PARALLEL = 8

VersionPicker = Callable[[bytes, list[int]], list[int]]
"""(the model's config.pbtxt, its published versions) → the versions to fetch."""


class CacheFullError(OctacloudError):
    """A node cache cannot make room under its size limit: what it holds is in use."""


@dataclass(frozen=True, slots=True)
class Entry:
    model: str
    version: int
    bytes: int
    used_at: float


@dataclass(frozen=True, slots=True)
class EntryOutcome:
    hit: bool
    files: int = 0
    bytes: int = 0
    refetched: str = ""
    evicted: int = 0
    store_error: str = ""


class NodeCache:
    """One node's model cache at ``root``, at most ``limit_bytes`` (None: no limit)."""

    def __init__(
        self,
        root: Path,
        limit_bytes: int | None = None,
        *,
        parallel: int = PARALLEL,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.parallel = max(1, parallel)
        self.chunk_bytes = max(1, chunk_bytes)
        self.leases = Leases(root)
        self.stats = CacheStats()

    # ---- fetching ----------------------------------------------------------------------------------------

    def fetch(
        self, store: ModelStore, model: str, pick: VersionPicker | Sequence[int], lease: str | None = None
    ) -> FetchResult:
        """Make the versions of ``model`` that ``pick`` chooses available under ``root/<model>``; returns
        where, and what it cost. ``lease`` names the replica the versions are held for: this process holds the
        lease until :meth:`release` or its exit, and eviction never removes them meanwhile."""
        started = time.monotonic()
        store_error = ""
        try:
            config = store.read(model, CONFIG_FILE)
            available = store.versions(model)
        except StoreUnavailableError as exc:
            store_error = str(exc)
            config, available = self._cached_config(model, exc), self.cached_versions(model)
        fresh = not store_error  # the config came from the store
        versions = sorted(set(pick(config, available) if callable(pick) else pick))
        if not versions:
            raise NotFoundError(f"model {model!r} has no published version in the model storage {store.url}")
        missing = [v for v in versions if v not in available]
        if missing:
            if store_error:
                raise StoreUnavailableError(f"{store_error}; version(s) {missing} of {model!r} are not cached here")
            raise NotFoundError(f"model {model!r} has no version {missing[0]} in the model storage {store.url}")
        if lease is not None:
            self.leases.hold(lease, [entry_key(model, v) for v in versions])
        try:
            keep = frozenset(entry_key(model, v) for v in versions)
            outcomes = [self._ensure(store, model, v, store_error, keep) for v in versions]
            store_error = store_error or next((o.store_error for o in outcomes if o.store_error), "")
            if fresh:
                self._write_config(model, config)
        except BaseException:
            if lease is not None:
                self.leases.release(lease)
            raise
        result = FetchResult(
            self.root / model,
            all(o.hit for o in outcomes),
            sum(o.files for o in outcomes),
            sum(o.bytes for o in outcomes),
            time.monotonic() - started,
            tuple(versions),
            tuple(o.refetched for o in outcomes if o.refetched),
            store_error,
            sum(o.evicted for o in outcomes),
        )
        self.stats.record(result)
        return result

    def hold(self, lease: str, model: str, versions: Sequence[int]) -> None:
        """This process (a replica started from them) leases cached versions under the name ``lease``."""
        self.leases.hold(lease, [entry_key(model, v) for v in versions])

    def release(self, lease: str) -> None:
        """The replica ``lease`` stopped: its versions may be evicted again."""
        self.leases.release(lease)

    def cached_versions(self, model: str) -> list[int]:
        folder = self.root / model
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / ENTRY_FILE).is_file())

    def entries(self) -> list[Entry]:
        """Every complete entry, least recently used first."""
        found = []
        for marker in self.root.glob(f"*/*/{ENTRY_FILE}"):
            version_dir = marker.parent
            if not version_dir.name.isdigit() or version_dir.parent.name.startswith("."):
                continue
            try:
                size = int(json.loads(marker.read_text())["bytes"])
                used = marker.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue
            found.append(Entry(version_dir.parent.name, int(version_dir.name), size, used))
        return sorted(found, key=lambda e: (e.used_at, e.model, e.version))

    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    # ---- one version --------------------------------------------------------------------------------------

    def _ensure(
        self, store: ModelStore, model: str, version: int, store_error: str, keep: frozenset[str]
    ) -> EntryOutcome:
        key = entry_key(model, version)
        with locked(self.root / ".locks" / f"{key}.lock"):
            self._clear_staging(key)
            target = self.root / model / str(version)
            fingerprint, remote = "", None
            if not store_error:
                try:
                    fingerprint, remote = self._remote(store, model, version)
                except StoreUnavailableError as exc:  # it went away since the config was read
                    store_error = str(exc)
            bad = self._check(target, fingerprint)
            if not bad:
                os.utime(target / ENTRY_FILE)  # its last use, for LRU
                return EntryOutcome(True, store_error=store_error)
            if store_error or remote is None:
                raise StoreUnavailableError(f"{store_error}; {key} is not usable from the cache: {bad}")
            refetched = "" if bad == "not cached" else f"{key}: {bad}"
            self._discard(target)
            evicted = self._reserve(key, remote.total_bytes, keep)
            try:
                files = self._download(store, model, version, remote, fingerprint, target)
            finally:
                (self.root / ".reservations" / key).unlink(missing_ok=True)
            return EntryOutcome(False, files, remote.total_bytes, refetched, evicted)

    def _remote(self, store: ModelStore, model: str, version: int) -> tuple[str, Manifest]:
        """The store's fingerprint of a version and what its files should be (sizes, SHA-256 when published
        with a manifest; without one, sizes only: the SHA-256 is taken of what arrives)."""
        listing = store.files(model, version)
        if MANIFEST_FILE in listing:
            text = store.read(model, f"{version}/{MANIFEST_FILE}")
            where = f"{store.url}/{model}/{version}/{MANIFEST_FILE}"
            return "sha256:" + hashlib.sha256(text).hexdigest(), Manifest.from_json(text, where)
        files = {rel: FileDigest(f.size, "") for rel, f in listing.items()}
        marks = json.dumps(sorted((rel, f.size, f.marker) for rel, f in listing.items()))
        return "listing:" + hashlib.sha256(marks.encode()).hexdigest(), Manifest(files)

    def _check(self, target: Path, fingerprint: str) -> str:
        """'' when the entry at ``target`` is complete, intact and (``fingerprint`` given) current; else why not."""
        try:
            record = json.loads((target / ENTRY_FILE).read_text())
            files = {k: FileDigest(int(v[0]), str(v[1])) for k, v in record["files"].items()}
            cached_fingerprint = str(record["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return "not cached"
        if fingerprint and fingerprint != cached_fingerprint:
            return "the store has a new build of it"
        bad = mismatches(target, Manifest(files))
        return "; ".join(bad[:3])

    def _download(
        self, store: ModelStore, model: str, version: int, remote: Manifest, fingerprint: str, target: Path
    ) -> int:
        key = entry_key(model, version)
        staging = self.root / ".staging" / f"{key}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            jobs: list[tuple[str, int, int]] = []
            for rel, digest in sorted(remote.files.items()):
                path = staging / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("wb") as f:
                    f.truncate(digest.size)
                jobs += [(rel, start, min(start + self.chunk_bytes, digest.size))
                         for start in range(0, digest.size, self.chunk_bytes)]  # fmt: skip
            with ThreadPoolExecutor(self.parallel, thread_name_prefix="model-fetch") as pool:
                list(pool.map(lambda job: self._fetch_range(store, model, version, staging, *job), jobs))
            digests = {rel: FileDigest(d.size, sha256_of(staging / rel)) for rel, d in remote.files.items()}
            wrong = [rel for rel, d in remote.files.items() if d.sha256 and d.sha256 != digests[rel].sha256]
            if wrong:
                raise StoreUnavailableError(
                    f"model storage {store.url}: {key} arrived with {', '.join(sorted(wrong))} not matching its "
                    "manifest's SHA-256 (the store holds damaged or half-uploaded files: publish the version again)"
                )
            record = {"files": {k: [d.size, d.sha256] for k, d in sorted(digests.items())},
                      "fingerprint": fingerprint, "bytes": remote.total_bytes, "source": store.url}  # fmt: skip
            (staging / ENTRY_FILE).write_text(json.dumps(record, sort_keys=True))
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return len(remote.files)

    def _fetch_range(self, store: ModelStore, model: str, version: int, staging: Path, rel: str, start: int,
                     end: int) -> None:  # fmt: skip
        data = store.read_range(model, f"{version}/{rel}", start, end)
        if len(data) != end - start:
            raise StoreUnavailableError(
                f"model storage {store.url}: {model}/{version}/{rel} bytes {start}-{end} came back as {len(data)} "
                "bytes (the file changed during the download?): try again"
            )
        fd = os.open(staging / rel, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start)
        finally:
            os.close(fd)

    # ---- room ----------------------------------------------------------------------------------------------

    def _reserve(self, key: str, need: int, keep: frozenset[str] = frozenset()) -> int:
        """Make room for ``need`` bytes (evicting unused entries, least recently used first); returns how many
        entries were evicted. Raises :class:`CacheFullError` when what is in use leaves no room."""
        reservations = self.root / ".reservations"
        reservations.mkdir(parents=True, exist_ok=True)
        with locked(self.root / ".locks" / "cache.lock"):
            evicted = 0
            if self.limit_bytes is not None:
                entries = self.entries()
                used = sum(e.bytes for e in entries) + self._reserved(exclude=key)
                leased = self.leases.live()
                for e in entries:
                    if used + need <= self.limit_bytes:
                        break
                    if entry_key(e.model, e.version) not in keep and self._evict(e, leased):
                        used -= e.bytes
                        evicted += 1
                if used + need > self.limit_bytes:
                    raise CacheFullError(self._full(key, need, used, leased))
            (reservations / key).write_text(str(need))
        return evicted

    def _full(self, key: str, need: int, used: int, leased: dict[str, set[str]]) -> str:
        held = ", ".join(sorted(leased)) or "versions being fetched"
        return (
            f"node cache {self.root} is full: {key} needs {need / 2**20:.1f} MiB, the limit is "
            f"{(self.limit_bytes or 0) / 2**20:.1f} MiB and {used / 2**20:.1f} MiB are in use by running replicas "
            f"({held}): raise --model-cache-size, or stop replicas of other models on this node"
        )

    def _reserved(self, exclude: str) -> int:
        """Bytes reserved by downloads in progress (a reservation whose download died is removed)."""
        total = 0
        for path in (self.root / ".reservations").glob("*"):
            if path.name == exclude:
                continue
            with locked(self.root / ".locks" / f"{path.name}.lock", blocking=False) as free:
                if free:  # nobody downloads it: left by a download that died
                    path.unlink(missing_ok=True)
                    continue
            try:
                total += int(path.read_text() or 0)
            except (OSError, ValueError):
                continue
        return total

    def _evict(self, e: Entry, leased: dict[str, set[str]]) -> bool:
        key = entry_key(e.model, e.version)
        if key in leased:
            return False
        with locked(self.root / ".locks" / f"{key}.lock", blocking=False) as free:
            if not free:
                return False  # being fetched or checked right now
            self._discard(self.root / e.model / str(e.version))
        return True

    def _discard(self, folder: Path) -> None:
        """Remove an entry's folder: renamed away first (so it is gone at once), then deleted."""
        if not folder.exists():
            return
        trash = self.root / ".trash" / f"{folder.parent.name}@{folder.name}-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        folder.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _clear_staging(self, key: str) -> None:
        """Remove what a download of ``key`` that died left (the caller holds ``key``'s lock)."""
        for leftover in (self.root / ".staging").glob(f"{key}-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    # ---- the config ------------------------------------------------------------------------------------------

    def _write_config(self, model: str, config: bytes) -> None:
        path = self.root / model / CONFIG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CONFIG_FILE}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(config)
        os.replace(tmp, path)

    def _cached_config(self, model: str, why: StoreUnavailableError) -> bytes:
        try:
            return (self.root / model / CONFIG_FILE).read_bytes()
        except OSError:
            raise StoreUnavailableError(f"{why}; model {model!r} is not cached on this node") from None
