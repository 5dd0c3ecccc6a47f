"""The cloud on Ray (two fake nodes, one machine) with its models in S3 (SeaweedFS on loopback): a replica
actor fetches from the store into its node's cache, a warm copy for the failover reserve is prefetched to the
other node by a Ray task pinned there, and with the store killed a new replica on that node starts from the
warm copy and serves."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from octacloud.control.ray.local import LocalRayCluster
from octacloud.core import Gpu, Node
from octacloud.storage.publish import publish_folder
from octacloud.storage.store import open_store
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.ray.harness import CloudThread, fast_config, ray_cloud, wait_until
from tests.storage.seaweed import SeaweedS3

pytestmark = pytest.mark.slow
NODES = [Node(n, 1000, 8192, tuple(Gpu(i, "FAKE-A100", 16384) for i in range(2))) for n in ("ray-a", "ray-b")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SeaweedS3, CloudThread]]:
    root = tmp_path_factory.mktemp("ray-store")
    server = SeaweedS3(root / "s3")
    server.start()
    server.create_bucket("models")
    credentials = server.credentials_file(root / "credentials")
    write_linear_model(root / "local", "linear")
    publish_folder(open_store("s3://models/repo", credentials), root / "local")
    temp = Path(f"/tmp/octacloud-ray-store-{os.getpid()}")  # Ray's socket paths must stay short
    cluster = LocalRayCluster(NODES, temp_dir=temp)
    config = fast_config(root / "var", root / "no-local-repository", policy="spread")
    config.model_storage, config.storage_credentials, config.warm_copies = "s3://models/repo", credentials, 1
    cloud = CloudThread(lambda: ray_cloud(config, cache_root=root / "node-cache", storage="s3://models/repo"))
    try:
        yield server, cloud
    finally:
        cloud.stop(stop_replicas=True)
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        server.stop()


def test_a_warm_copy_lets_a_replica_start_on_another_node_with_the_store_down(
    world: tuple[SeaweedS3, CloudThread],
) -> None:
    server, cloud = world
    spec = {"name": "lin", "model": "linear", "octants": 1, "max_replicas": 2}
    assert cloud.admin("POST", "/deployments", spec).status_code == 201
    wait_until("one ready replica", lambda: len(cloud.ready("lin")) == 1, timeout=120)
    first = cloud.ready("lin")[0]
    other = next(n.name for n in NODES if n.name != first["node"])
    events = [e["message"] for e in cloud.cloud.store.events(200)]
    assert any(f"model cache miss on {first['node']} v1" in m for m in events), events
    index = cloud.cloud.cached_models
    wait_until(f"a warm copy on {other}", lambda: cloud.call(lambda: index.holds(other, "linear")), timeout=120)
    server.kill()
    assert cloud.admin("POST", "/deployments/lin/scale", {"replicas": 2}).status_code == 200
    wait_until("two ready replicas", lambda: len(cloud.ready("lin")) == 2, timeout=120)
    second = next(r for r in cloud.ready("lin") if r["id"] != first["id"])
    assert second["node"] == other
    events = [e["message"] for e in cloud.cloud.store.events(400)]
    assert any(f"model cache hit on {other} v1" in m and "the store is unavailable" in m for m in events), events
    x = np.ones((2, IN), np.float32)
    for _ in range(4):  # both replicas, whichever the gateway picks
        np.testing.assert_allclose(cloud.infer("lin", x), expected_output(x), rtol=1e-5, atol=1e-5)
