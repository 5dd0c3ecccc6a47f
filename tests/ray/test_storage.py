"""Model storage: a shared repository (path or fsspec URL) and a per-node cache with measured hits and misses."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest

from octacloud.core.errors import NotFoundError
from octacloud.storage.cache import MANIFEST, FleetCacheStats, ModelCache, ModelCacheCollector


def write_model(repo: Path, name: str = "mlp", weights: bytes = b"w" * 4096) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.onnx").write_bytes(weights)
    (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n')


def test_first_fetch_copies_then_hits_until_the_source_changes(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    write_model(shared)
    cache = ModelCache(tmp_path / "node-a")

    first = cache.fetch(str(shared), "mlp")
    assert not first.hit and first.files_copied == 2 and first.bytes_copied == 4096 + len('name: "mlp"\n')
    assert (first.path / "1" / "model.onnx").read_bytes() == b"w" * 4096
    assert not (first.path / "1" / "model.onnx").is_symlink()  # a real local copy, not a link to shared storage

    second = cache.fetch(str(shared), "mlp")
    assert second.hit and second.bytes_copied == 0 and second.path == first.path

    weights = shared / "mlp" / "1" / "model.onnx"
    weights.write_bytes(b"v" * 5000)  # a new build of the same version
    os.utime(weights, (1, 1))
    third = cache.fetch(str(shared), "mlp")
    assert not third.hit and (third.path / "1" / "model.onnx").read_bytes() == b"v" * 5000
    assert (cache.stats.hits, cache.stats.misses) == (1, 2)
    assert cache.stats.hit_ratio == pytest.approx(1 / 3)
    assert "miss on node-a" in third.describe("node-a") and "hit on node-a" in second.describe("node-a")


def test_each_node_has_its_own_cache_and_a_damaged_cache_is_refilled(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    write_model(shared)
    a, b = ModelCache(tmp_path / "cache" / "a"), ModelCache(tmp_path / "cache" / "b")
    assert not a.fetch(str(shared), "mlp").hit
    assert not b.fetch(str(shared), "mlp").hit  # a replica placed on a new node copies once
    assert b.fetch(str(shared), "mlp").hit
    (tmp_path / "cache" / "b" / "mlp" / "1" / "model.onnx").unlink()
    assert not b.fetch(str(shared), "mlp").hit
    assert (tmp_path / "cache" / "b" / "mlp" / MANIFEST).exists()


def test_object_storage_through_fsspec(tmp_path: Path) -> None:
    bucket = f"memory://models-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{bucket}/bert/1/model.onnx", b"x" * 100)
    fs.pipe(f"{bucket}/bert/config.pbtxt", b'name: "bert"\n')
    cache = ModelCache(tmp_path / "node")
    got = cache.fetch(bucket, "bert")
    assert not got.hit and (got.path / "1" / "model.onnx").read_bytes() == b"x" * 100
    assert cache.fetch(bucket, "bert").hit
    with pytest.raises(NotFoundError, match="'nope' is not in the model storage"):
        cache.fetch(bucket, "nope")


def test_concurrent_fetches_on_one_node_copy_once(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    write_model(shared, weights=os.urandom(2**20))
    root = tmp_path / "node"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: ModelCache(root).fetch(str(shared), "mlp"), range(4)))
    assert sorted(r.hit for r in results) == [False, True, True, True]
    assert not [p for p in root.iterdir() if p.name.startswith((".staging", ".old"))]


def test_fleet_stats_count_per_node(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    write_model(shared)
    stats = FleetCacheStats()
    for node in ("a", "b", "a"):
        stats.record(node, ModelCache(tmp_path / node).fetch(str(shared), "mlp"))
    snap = stats.snapshot()
    assert (snap["a"].hits, snap["a"].misses, snap["b"].hits, snap["b"].misses) == (1, 1, 0, 1)


def test_cache_counts_as_prometheus_metrics(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    shared = tmp_path / "shared"
    write_model(shared)
    stats = FleetCacheStats()
    for node in ("a", "a", "b"):
        stats.record(node, ModelCache(tmp_path / node).fetch(str(shared), "mlp"))
    registry = CollectorRegistry()
    registry.register(ModelCacheCollector(stats))
    text = generate_latest(registry).decode()
    assert 'octacloud_model_cache_hits_total{node="a"} 1.0' in text
    assert 'octacloud_model_cache_misses_total{node="a"} 1.0' in text
    assert 'octacloud_model_cache_misses_total{node="b"} 1.0' in text
    assert 'octacloud_model_cache_copied_bytes_total{node="a"} 4108.0' in text
