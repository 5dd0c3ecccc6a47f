"""`octacloud down` after an `up --backend ray` stops the replica actors on Ray (not "stopped 0 replica(s)"
while the actor keeps serving), and leaves the deployment for the next `up`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ray
from octacloud.cli.main import app
from octacloud.control.ray.backend import NAMESPACE
from octacloud.control.ray.local import LocalRayCluster
from octacloud.core import Gpu, Node

from ..cluster.conftest import write_linear_model
from .harness import CloudThread, fast_config, ray_cloud, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    temp = Path(f"/tmp/octacloud-raydown-{os.getpid()}")  # Ray's socket paths must stay short
    cluster = LocalRayCluster([Node("ray-a", 1000, 8192, tuple(Gpu(i, "FAKE-A100", 16384) for i in range(2)))], temp)
    yield cluster
    cluster.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def test_down_stops_the_ray_replica_actors(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    write_linear_model(tmp_path / "models")
    config = fast_config(tmp_path / "var", tmp_path / "models")
    c = CloudThread(lambda: ray_cloud(config, cache_root=tmp_path / "node-cache"))
    try:
        created = c.admin("POST", "/deployments", {"name": "linear", "model": "linear", "octants": 2})
        assert created.status_code == 201, created.text
        wait_until("a ready replica", lambda: len(c.ready("linear")) == 1, timeout=120)
        handle = c.ready("linear")[0]["handle"]
    finally:
        c.stop(stop_replicas=False)  # as Ctrl-C on `up`: the replica keeps serving
    assert ray.get_actor(handle, namespace=NAMESPACE) is not None
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path / "var"), "--grace", "2"])
    assert result.exit_code == 0, result.output
    assert "stopped 1 replica(s)" in result.output
    with pytest.raises(ValueError, match="look up actor"):
        ray.get_actor(handle, namespace=NAMESPACE)  # the actor is gone, its octants free again
    again = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path / "var")])
    assert again.exit_code == 0 and "stopped 0 replica(s)" in again.output, again.output
