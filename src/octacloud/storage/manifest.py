"""A version's manifest: the size and SHA-256 of every file, written when the version is published and checked
whenever a node fetches it or starts a replica from its cache.

``<model>/<version>/octacloud-manifest.json``::

    {"format": 1, "files": {"model.onnx": {"size": 102400, "sha256": "…"}, "profile.json": {…}}}

The manifest does not list itself. A version published without one (a folder repository from before
manifests) is fetched by the store's sizes, and the cache records the SHA-256 of what it fetched, so a cached
file that changes on the node's disk afterwards is still caught.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from octacloud.core.errors import InvalidSpecError
from octacloud.storage.store import MANIFEST_FILE

FORMAT = 1
HASH_BLOCK = 4 * 2**20


@dataclass(frozen=True, slots=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """The files of one version: relative path → size and SHA-256."""

    files: Mapping[str, FileDigest]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        files = {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())}
        return json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        try:
            data = json.loads(text)
            files = data["files"]
            if data.get("format") != FORMAT or not isinstance(files, dict):
                raise ValueError(f"format {data.get('format')!r}")
            parsed = {str(k): FileDigest(int(v["size"]), str(v["sha256"])) for k, v in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidSpecError(f"{where}: not an octacloud manifest ({exc}); publish the version again") from None
        for rel, digest in parsed.items():
            if rel.startswith("/") or ".." in rel.split("/") or len(digest.sha256) != 64 or digest.size < 0:
                raise InvalidSpecError(f"{where}: bad entry {rel!r}; publish the version again")
        return cls(parsed)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def manifest_of(folder: Path) -> Manifest:
    """The manifest of a version folder on local disk (every file under it but the manifest and dot-files)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST_FILE and not any(p.startswith(".") for p in rel.split("/")):
            files[rel] = FileDigest(path.stat().st_size, sha256_of(path))
    return Manifest(files)


def write_manifest(folder: Path) -> Manifest:
    """Write ``folder``'s manifest into it (the toolchain does at publish) and return it."""
    manifest = manifest_of(folder)
    (folder / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def mismatches(folder: Path, manifest: Manifest) -> list[str]:
    """The files of ``folder`` that are missing or differ from ``manifest`` (size first, then SHA-256)."""
    bad = []
    for rel, want in sorted(manifest.files.items()):
        path = folder / rel
        try:
            size = path.stat().st_size
        except OSError:
            bad.append(f"{rel} is missing")
            continue
        if size != want.size:
            bad.append(f"{rel} has {size} bytes, not {want.size}")
        elif sha256_of(path) != want.sha256:
            bad.append(f"{rel} does not match its SHA-256")
    return bad
