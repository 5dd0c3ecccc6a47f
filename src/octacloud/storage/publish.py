"""Publishing a model version into a store: files first (in parallel), then the version's manifest, then the
model's config.

A reader lists a version of an object store only once its manifest is there (:meth:`ModelStore.versions`),
so a publish that dies half-way leaves files nobody serves; publishing the same version again replaces them.
Published versions are immutable: a version already published with other content is refused (publish a new
version instead), one published with the same content is skipped.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.storage.manifest import Manifest, manifest_of
from octacloud.storage.store import CONFIG_FILE, MANIFEST_FILE, ModelStore

PARALLEL_UPLOADS = 8


@dataclass(frozen=True, slots=True)
class Published:
    model: str
    version: int
    files: int
    bytes: int
    skipped: bool = False
    """The store already had this version with the same content."""


def published_manifest(store: ModelStore, model: str, version: int) -> Manifest | None:
    """The manifest of ``model`` version ``version`` in ``store``, or None when it has none."""
    try:
        text = store.read(model, f"{version}/{MANIFEST_FILE}")
    except NotFoundError:
        return None
    return Manifest.from_json(text, f"{store.url}/{model}/{version}/{MANIFEST_FILE}")


def publish_version(store: ModelStore, model: str, version: int, folder: Path, config: bytes) -> Published:
    """Upload ``folder`` (a version's files) as ``model`` version ``version``, then ``config`` as its config."""
    if version < 1:
        raise InvalidSpecError(f"version must be 1 or more, got {version}")
    manifest = manifest_of(folder)
    if not manifest.files:
        raise InvalidSpecError(f"{folder}: no files to publish as {model} version {version}")
    existing = published_manifest(store, model, version)
    if existing is not None:
        if existing.files != manifest.files:
            raise InvalidSpecError(
                f"{store.url}/{model} already has a version {version} with other content: published versions "
                "are immutable, publish a new version"
            )
        _put_config(store, model, config)
        return Published(model, version, len(manifest.files), manifest.total_bytes, skipped=True)
    with ThreadPoolExecutor(PARALLEL_UPLOADS, thread_name_prefix="model-publish") as pool:
        list(pool.map(lambda rel: store.put(model, f"{version}/{rel}", folder / rel), sorted(manifest.files)))
    store.put(model, f"{version}/{MANIFEST_FILE}", manifest.to_json().encode())  # the version is visible now
    _put_config(store, model, config)
    return Published(model, version, len(manifest.files), manifest.total_bytes)


def _put_config(store: ModelStore, model: str, config: bytes) -> None:
    try:
        if store.read(model, CONFIG_FILE) == config:
            return
    except NotFoundError:
        pass
    store.put(model, CONFIG_FILE, config)


def publish_folder(store: ModelStore, source: Path, models: list[str] | None = None) -> list[Published]:
    """Publish a Triton-layout repository on local disk into ``store``, version numbers kept (each model's
    numeric version folders, then its ``config.pbtxt``)."""
    names = models or sorted(
        p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / CONFIG_FILE).is_file()
    )
    out = []
    for name in names:
        folder = source / name
        if not (folder / CONFIG_FILE).is_file():
            raise NotFoundError(f"{folder} is not a model folder (no {CONFIG_FILE})")
        config = (folder / CONFIG_FILE).read_bytes()
        versions = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name))
        if not versions:
            raise NotFoundError(f"{folder} has no version folders")
        for v in versions:
            out.append(publish_version(store, name, v, folder / str(v), config))
    return out
