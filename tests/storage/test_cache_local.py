"""The node cache over stores that need no server: a folder (the default) and ``memory://``; its counts as
Prometheus metrics; sizes as people write them."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest

from octacloud.control.models import fetch_model
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.storage.cache import NodeCache
from octacloud.storage.manifest import write_manifest
from octacloud.storage.sizes import parse_size
from octacloud.storage.stats import FleetCacheStats, ModelCacheCollector
from octacloud.storage.store import FsspecStore
from tests.storage.conftest import write_version


def test_a_folder_store_without_manifests_is_fetched_by_its_sizes_and_checked_after(tmp_path: Path) -> None:
    write_version(tmp_path / "shared", "mlp", 1, b"w" * 4096)
    store = FsspecStore(str(tmp_path / "shared"))
    cache = NodeCache(tmp_path / "node")
    first = fetch_model(cache, store, "mlp", "")
    assert not first.hit and first.bytes_copied == 4096
    assert not (first.path / "1" / "model.onnx").is_symlink()  # a real local copy
    assert fetch_model(cache, store, "mlp", "").hit
    (first.path / "1" / "model.onnx").write_bytes(b"x" * 4096)  # damaged on the node: caught by the SHA-256 taken
    again = fetch_model(cache, store, "mlp", "")
    assert not again.hit and (first.path / "1" / "model.onnx").read_bytes() == b"w" * 4096
    weights = tmp_path / "shared" / "mlp" / "1" / "model.onnx"
    weights.write_bytes(b"v" * 5000)  # a new build of the same version in the store
    os.utime(weights, (1, 1))
    rebuilt = fetch_model(cache, store, "mlp", "")
    assert not rebuilt.hit and rebuilt.refetched == ("mlp@1: the store has a new build of it",)


def test_a_folder_store_with_manifests_is_checked_against_them(tmp_path: Path) -> None:
    folder = write_version(tmp_path / "shared", "mlp", 1, b"w" * 100)
    write_manifest(folder)
    store = FsspecStore(str(tmp_path / "shared"))
    assert store.versions("mlp") == [1] and "octacloud-manifest.json" in store.files("mlp", 1)
    got = fetch_model(NodeCache(tmp_path / "node"), store, "mlp", "")
    assert got.files_copied == 1 and (got.path / "1" / "model.onnx").read_bytes() == b"w" * 100


def test_object_storage_through_fsspec(tmp_path: Path) -> None:
    bucket = f"memory://models-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    write_manifest(write_version(local, "bert", 1, b"x" * 100))
    fs = fsspec.filesystem("memory")
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe(f"{bucket}/{path.relative_to(local).as_posix()}", path.read_bytes())
    store = FsspecStore(bucket)
    cache = NodeCache(tmp_path / "node")
    got = fetch_model(cache, store, "bert", "")
    assert not got.hit and (got.path / "1" / "model.onnx").read_bytes() == b"x" * 100
    assert fetch_model(cache, store, "bert", "").hit
    with pytest.raises(NotFoundError, match="'nope' is not in the model storage"):
        fetch_model(cache, store, "nope", "")


def test_concurrent_fetches_on_one_node_copy_once(tmp_path: Path) -> None:
    write_version(tmp_path / "shared", "mlp", 1, os.urandom(2**20))
    store, root = FsspecStore(str(tmp_path / "shared")), tmp_path / "node"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fetch_model(NodeCache(root), store, "mlp", ""), range(4)))
    assert sorted(r.hit for r in results) == [False, True, True, True]
    assert not list((root / ".staging").iterdir())


def test_cache_counts_per_node_as_prometheus_metrics(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    write_version(tmp_path / "shared", "mlp", 1, b"w" * 4096)
    store = FsspecStore(str(tmp_path / "shared"))
    stats = FleetCacheStats()
    for node in ("a", "a", "b"):
        stats.record(node, fetch_model(NodeCache(tmp_path / node), store, "mlp", ""))
    snap = stats.snapshot()
    assert (snap["a"].hits, snap["a"].misses, snap["b"].hits, snap["b"].misses) == (1, 1, 0, 1)
    registry = CollectorRegistry()
    registry.register(ModelCacheCollector(stats))
    text = generate_latest(registry).decode()
    assert 'octacloud_model_cache_hits_total{node="a"} 1.0' in text
    assert 'octacloud_model_cache_misses_total{node="b"} 1.0' in text
    assert 'octacloud_model_cache_copied_bytes_total{node="a"} 4096.0' in text
    assert 'octacloud_model_cache_evictions_total{node="a"} 0.0' in text


@pytest.mark.parametrize(
    ("text", "size"), [("1024", 1024), ("20GiB", 20 * 2**30), ("500MB", 500 * 10**6), ("1.5 gi", 3 * 2**29)]
)
def test_sizes_as_people_write_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "ten", "-1", "0", "5 PB"])
def test_a_size_that_is_not_one_says_so(text: str) -> None:
    with pytest.raises(InvalidSpecError, match="--model-cache-size"):
        parse_size(text)


def test_footprints_outlive_the_store_and_are_reread_after_their_ttl(tmp_path: Path) -> None:
    from octacloud.control.probes import RepositoryFootprints
    from octacloud.storage.store import StoreUnavailableError

    write_version(tmp_path / "shared", "mlp", 1, b"w" * 4096)
    store = FsspecStore(str(tmp_path / "shared"))
    clock = [0.0]
    footprints = RepositoryFootprints(store, ttl_s=10, now=lambda: clock[0])
    first = footprints("mlp")
    assert first.weights_bytes == 4096

    def down(*_: object) -> list[int]:
        raise StoreUnavailableError("model storage s3://x: cannot read it")

    store.versions = down  # type: ignore[method-assign]
    clock[0] = 60.0
    assert footprints("mlp") == first  # the last one read
    with pytest.raises(NotFoundError, match="footprint of 'bert' is unknown: model storage s3://x"):
        footprints("bert")  # never read: the loop places it without one


def test_storage_metering_reads_the_sizes_the_store_reports(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from octacloud.control.usage import ClusterUsage
    from octacloud.storage.store import StoreUnavailableError

    bucket = f"memory://metered-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{bucket}/mlp/config.pbtxt", b"x" * 10)
    fs.pipe(f"{bucket}/mlp/1/model.onnx", b"w" * 1000)
    store = FsspecStore(bucket)
    deployment = SimpleNamespace(spec=SimpleNamespace(model="mlp", tenant="acme", name="lin"))
    controller = SimpleNamespace(models=store, store=SimpleNamespace(deployments=lambda: [deployment]))
    clock = [0.0]
    usage = ClusterUsage(controller, storage_ttl_s=60, now=lambda: clock[0])  # type: ignore[arg-type]
    (stored,) = usage.storage()
    assert (stored.tenant, stored.deployment, stored.bytes) == ("acme", "lin", 1010)

    def down(_model: str) -> int:
        raise StoreUnavailableError("model storage memory://x: cannot read it")

    store.size = down  # type: ignore[method-assign]
    clock[0] = 120.0  # re-measured: the store is away, the last size stands
    assert usage.storage()[0].bytes == 1010
