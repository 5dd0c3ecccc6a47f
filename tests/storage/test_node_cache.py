"""The node cache against a real S3 store (SeaweedFS on loopback): fetch and hit, only the versions needed,
ranged parallel downloads, one download per node across processes, eviction under a size limit that spares
what replicas use, a damaged cached file fetched again, ``kill -9`` in the middle of a download, and the store
going away while models are cached."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from octacloud.control.models import fetch_model
from octacloud.core.errors import NotFoundError
from octacloud.storage.cache import ENTRY_FILE, CacheFullError, NodeCache
from octacloud.storage.publish import publish_folder
from octacloud.storage.store import FsspecStore, StoreUnavailableError, open_store
from tests.storage.conftest import random_bytes, write_version
from tests.storage.seaweed import SeaweedS3

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def published(store: FsspecStore, local: Path, name: str, versions: dict[int, bytes]) -> None:
    for version, weights in versions.items():
        write_version(local, name, version, weights)
    publish_folder(store, local, [name])


def test_fetch_copies_once_then_hits(s3_store: FsspecStore, tmp_path: Path) -> None:
    weights = random_bytes(3 * 2**20 + 17)
    published(s3_store, tmp_path / "local", "mlp", {1: weights})
    cache = NodeCache(tmp_path / "node", chunk_bytes=2**20, parallel=4)  # 4 ranges of the big file at once
    first = fetch_model(cache, s3_store, "mlp", "")
    assert not first.hit and first.versions == (1,) and first.bytes_copied == len(weights) and first.files_copied == 1
    assert (first.path / "1" / "model.onnx").read_bytes() == weights
    assert (first.path / "config.pbtxt").read_text().startswith('name: "mlp"')
    second = fetch_model(cache, s3_store, "mlp", "")
    assert second.hit and second.bytes_copied == 0
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_only_the_versions_a_deployment_needs(s3_store: FsspecStore, tmp_path: Path) -> None:
    published(s3_store, tmp_path / "local", "mlp", {1: b"one" * 100, 2: b"two" * 100, 3: b"three" * 100})
    cache = NodeCache(tmp_path / "node")
    assert fetch_model(cache, s3_store, "mlp", "").versions == (3,)  # Triton's default policy: the latest
    assert fetch_model(cache, s3_store, "mlp", "1").versions == (1,)
    assert cache.cached_versions("mlp") == [1, 3]
    with pytest.raises(NotFoundError, match="has no version 7"):
        fetch_model(cache, s3_store, "mlp", "7")


def test_a_damaged_cached_file_is_fetched_again_never_served(s3_store: FsspecStore, tmp_path: Path) -> None:
    weights = random_bytes(2**20)
    published(s3_store, tmp_path / "local", "mlp", {1: weights})
    cache = NodeCache(tmp_path / "node")
    cached = fetch_model(cache, s3_store, "mlp", "").path / "1" / "model.onnx"
    with cached.open("r+b") as f:  # one flipped byte, same size, same folder: what a bad disk does
        f.seek(1000)
        f.write(bytes([weights[1000] ^ 0xFF]))
    again = fetch_model(cache, s3_store, "mlp", "")
    assert not again.hit and again.refetched == ("mlp@1: model.onnx does not match its SHA-256",)
    assert cached.read_bytes() == weights
    assert cache.stats.refetches == 1


def test_a_version_damaged_in_the_store_is_refused_and_nothing_is_cached(s3_store: FsspecStore, tmp_path: Path) -> None:
    published(s3_store, tmp_path / "local", "mlp", {1: b"a" * 4096})
    s3_store.put("mlp", "1/model.onnx", b"b" * 4096)  # rewritten behind the manifest's back
    cache = NodeCache(tmp_path / "node")
    with pytest.raises(StoreUnavailableError, match=r"mlp@1 arrived with model.onnx not matching its manifest"):
        fetch_model(cache, s3_store, "mlp", "")
    assert cache.cached_versions("mlp") == [] and not (tmp_path / "node" / "mlp" / "1").exists()


def test_eviction_under_a_size_limit_spares_a_model_in_use(s3_store: FsspecStore, tmp_path: Path) -> None:
    size = 2**20
    for name in ("a", "b", "c", "d"):
        published(s3_store, tmp_path / "local", name, {1: random_bytes(size)})
    cache = NodeCache(tmp_path / "node", limit_bytes=size * 5 // 2)  # room for two
    fetch_model(cache, s3_store, "a", "")
    hold = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from octacloud.storage.cache import NodeCache
        NodeCache(Path({str(tmp_path / "node")!r})).hold("replica-a", "a", [1])
        print("held", flush=True)
        time.sleep(600)
    """)  # a replica serving a@1: another process, as a replica is (or another pod on the node)
    replica = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, env={**os.environ,
                               "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    try:
        assert replica.stdout is not None and replica.stdout.readline() == b"held\n"
        fetch_model(cache, s3_store, "b", "")
        got = fetch_model(cache, s3_store, "c", "", lease="replica-c")
        assert got.evicted == 1 and cache.cached_versions("b") == [] and not (tmp_path / "node" / "b" / "1").exists()
        assert cache.cached_versions("a") == [1] and cache.used_bytes() <= cache.limit_bytes  # type: ignore[operator]
        with pytest.raises(CacheFullError, match=r"node cache .* is full: d@1 needs 1.0 MiB.*a@1, c@1"):
            fetch_model(cache, s3_store, "d", "")
    finally:
        replica.kill()
        replica.communicate()  # reaps it and closes its pipe
    cache.release("replica-c")
    assert fetch_model(cache, s3_store, "d", "").evicted == 1  # a's replica died: its lease with it
    assert cache.used_bytes() <= size * 5 // 2


def _fetch_script(root: Path, credentials: Path, url: str, model: str, hang_after_first_range: Path | None) -> str:
    return textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from octacloud.control.models import fetch_model
        from octacloud.storage.cache import NodeCache
        from octacloud.storage.store import open_store
        store = open_store({url!r}, Path({str(credentials)!r}))
        hang = {str(hang_after_first_range) if hang_after_first_range else None!r}
        if hang:
            read_range = store.read_range
            def slow(*args):
                data = read_range(*args)
                Path(hang).write_text("one range written")
                time.sleep(600)
                return data
            store.read_range = slow
        cache = NodeCache(Path({str(root)!r}), chunk_bytes=2**20, parallel=1)
        r = fetch_model(cache, store, {model!r}, "")
        print(json.dumps({{"hit": r.hit, "bytes": r.bytes_copied}}))
    """)


def test_one_download_per_node_however_many_processes_ask(
    s3_store: FsspecStore, credentials: Path, tmp_path: Path
) -> None:
    weights = random_bytes(4 * 2**20)
    published(s3_store, tmp_path / "local", "mlp", {1: weights})
    script = _fetch_script(tmp_path / "node", credentials, s3_store.url, "mlp", None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env) for _ in range(4)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(r["hit"] for r in results) == [False, True, True, True]
    assert sum(r["bytes"] for r in results) == len(weights)  # the model's size, once


def test_kill_9_during_a_download_leaves_nothing_half_written_served(
    s3_store: FsspecStore, credentials: Path, tmp_path: Path
) -> None:
    weights = random_bytes(3 * 2**20)
    published(s3_store, tmp_path / "local", "mlp", {1: weights})
    root, marker = tmp_path / "node", tmp_path / "first-range"
    script = _fetch_script(root, credentials, s3_store.url, "mlp", marker)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while not marker.exists():  # the download is under way: one range on disk, the rest not
            assert proc.poll() is None, "the fetch ended before it was killed"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (root / "mlp" / "1").exists()  # nothing where a replica would look
    assert list((root / ".staging").iterdir())  # the half download, out of the way
    cache = NodeCache(root)
    got = fetch_model(cache, s3_store, "mlp", "")
    assert not got.hit and (got.path / "1" / "model.onnx").read_bytes() == weights
    assert not list((root / ".staging").iterdir()) and not list((root / ".reservations").iterdir())
    assert json.loads((got.path / "1" / ENTRY_FILE).read_text())["bytes"] == len(weights)


def test_with_the_store_away_cached_models_start_and_others_fail_clearly(tmp_path: Path) -> None:
    server = SeaweedS3(tmp_path / "store")
    server.start()
    server.create_bucket("models")
    store = open_store("s3://models/repo", server.credentials_file(tmp_path / "creds"))
    published(store, tmp_path / "local", "mlp", {1: b"m" * 5000})
    published(store, tmp_path / "local", "bert", {1: b"b" * 5000})
    cache = NodeCache(tmp_path / "node")
    fetch_model(cache, store, "mlp", "")
    server.kill()
    try:
        cached = fetch_model(cache, store, "mlp", "")
        assert cached.hit and f"model storage s3://models/repo at {server.endpoint}: cannot" in cached.store_error
        assert "started from the cache, the store is unavailable" in cached.describe("n1")
        with pytest.raises(StoreUnavailableError, match=r"s3://models/repo at .*; model 'bert' is not cached"):
            fetch_model(cache, store, "bert", "")
        assert (cached.path / "1" / "model.onnx").read_bytes() == b"m" * 5000  # nothing cached was lost
        server.start()
        published(store, tmp_path / "local", "mlp", {2: b"n" * 5000})  # published while the node was cut off
        caught_up = fetch_model(cache, store, "mlp", "")
        assert caught_up.versions == (2,) and not caught_up.hit and caught_up.store_error == ""
        assert fetch_model(cache, store, "bert", "").bytes_copied == 5000
    finally:
        server.stop()
