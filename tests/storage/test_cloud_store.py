"""The cloud on a model store in S3 (SeaweedFS on loopback), local replicas: publish, deploy from the store,
serve, scale out with one download per node, the cold start exported in parts, and the store killed while
replicas run: they keep serving, one killed with ``kill -9`` starts again from the node cache, and a model
that is not cached is refused with the store's name and the reason."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from octacloud.app import Cloud
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from octacloud.storage.publish import publish_folder
from octacloud.storage.store import open_store
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.ray.harness import CloudThread, fast_config, wait_until
from tests.storage.seaweed import SeaweedS3

pytestmark = pytest.mark.slow
FLEET = [Node("node-a", 8000, 65536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2)))]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SeaweedS3, CloudThread, Path]]:
    root = tmp_path_factory.mktemp("cloud-store")
    server = SeaweedS3(root / "s3")
    server.start()
    server.create_bucket("models")
    credentials = server.credentials_file(root / "credentials")
    local = root / "local"
    write_linear_model(local, "linear")
    write_linear_model(local, "other")
    publish_folder(open_store("s3://models/repo", credentials), local, ["linear"])  # "other" is published later
    config = fast_config(root / "state", root / "no-local-repository")
    config.model_storage, config.storage_credentials = "s3://models/repo", credentials
    config.model_cache_size = 64 * 2**20
    cloud = CloudThread(lambda: Cloud(config, nodes=FLEET))
    try:
        yield server, cloud, local
    finally:
        cloud.stop(stop_replicas=True)
        server.stop()


def fetches(cloud: CloudThread) -> list[dict[str, object]]:
    replicas = cloud.cloud.config.state_dir / "replicas"
    return [json.loads(p.read_text()) for p in sorted(replicas.glob("*/fetch.json"))]


def cold_start(cloud: CloudThread, replica: dict[str, object]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from octacloud.security.internal_auth import REPLICA_HEADER

    headers = {**internal(cloud), REPLICA_HEADER: str(replica["id"])}
    metrics = httpx.get(f"http://127.0.0.1:{replica['metrics_port']}/metrics", headers=headers, timeout=10)
    parts = {}
    for family in text_string_to_metric_families(metrics.text):
        for sample in family.samples:
            if sample.name == "octacloud_replica_cold_start_seconds":
                parts[sample.labels["part"]] = sample.value
    return parts


def internal(cloud: CloudThread) -> dict[str, str]:
    from octacloud.security.internal_auth import HEADER

    return {HEADER: cloud.cloud.internal_secret}


def test_deploy_from_the_store_scale_out_one_download(world: tuple[SeaweedS3, CloudThread, Path]) -> None:
    _, cloud, _ = world
    spec = {"name": "lin", "model": "linear", "octants": 1, "max_replicas": 4}
    assert cloud.admin("POST", "/deployments", spec).status_code == 201
    wait_until("one ready replica", lambda: len(cloud.ready("lin")) == 1)
    x = np.random.default_rng(0).standard_normal((2, IN)).astype(np.float32)
    np.testing.assert_allclose(cloud.infer("lin", x), expected_output(x), rtol=1e-5, atol=1e-5)
    assert cloud.admin("POST", "/deployments/lin/scale", {"replicas": 3}).status_code == 200
    wait_until("three ready replicas", lambda: len(cloud.ready("lin")) == 3)
    got = fetches(cloud)
    assert len(got) == 3 and sorted(bool(f["hit"]) for f in got) == [False, True, True]
    size = sum(int(f["bytes"]) for f in got)  # type: ignore[call-overload]
    assert size == sum(p.stat().st_size for p in (world[2] / "linear" / "1").iterdir())  # the model, once
    parts = cold_start(cloud, cloud.ready("lin")[0])
    assert set(parts) == {"fetch", "load", "warmup"} and all(v >= 0 for v in parts.values())


def test_the_store_killed_replicas_serve_and_restart_from_the_cache(
    world: tuple[SeaweedS3, CloudThread, Path],
) -> None:
    server, cloud, local = world
    if not cloud.ready("lin"):
        pytest.skip("needs the deployment of the test before")
    server.kill()
    x = np.ones((1, IN), np.float32)
    np.testing.assert_allclose(cloud.infer("lin", x), expected_output(x), rtol=1e-5, atol=1e-5)
    victim = cloud.ready("lin")[0]
    os.kill(int(victim["pid"]), signal.SIGKILL)
    wait_until("the killed replica started again", lambda: victim["pid"] not in {r["pid"] for r in cloud.ready("lin")}
               and len(cloud.ready("lin")) == 3)  # fmt: skip
    np.testing.assert_allclose(cloud.infer("lin", x), expected_output(x), rtol=1e-5, atol=1e-5)
    from_cache = [f for f in fetches(cloud) if f["store_error"]]  # the replacement's fetch: the cache alone
    assert len(from_cache) == 1 and from_cache[0]["hit"] and "cannot read it" in str(from_cache[0]["store_error"])
    refused = cloud.admin("POST", "/deployments", {"name": "oth", "model": "other", "octants": 1})
    assert refused.status_code == 503, refused.text
    assert f"model storage s3://models/repo at {server.endpoint}: cannot read it" in refused.json()["error"]
    server.start()  # back: publishing and deploying work again, nothing cached was lost
    publish_folder(open_store("s3://models/repo", cloud.cloud.config.storage_credentials), local, ["other"])
    assert cloud.admin("POST", "/deployments", {"name": "oth", "model": "other", "octants": 1}).status_code == 201
    wait_until("the new model ready", lambda: len(cloud.ready("oth")) == 1)
    cache = cloud.cloud.cache_root
    assert (cache / "linear" / "1").is_dir() and (cache / "other" / "1").is_dir()
