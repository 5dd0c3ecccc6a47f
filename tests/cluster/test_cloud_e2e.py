"""End to end: the cloud with real replicas, driven as a user would (admin API and tritonclient through the
gateway): deploy, infer, scale, kill -9 under load, controller restart, preemption, undeploy.

Every test runs on both placement backends: ``local`` (replicas are processes of this machine) and ``ray``
(the same fleet as one Ray node, replicas are actors pinned to it; see tests/ray for several nodes)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from octacloud.app import Cloud, CloudConfig
from octacloud.control.controller import ControllerSettings
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from octacloud.security.internal_auth import HEADER

from ..ray.harness import ray_cloud
from .conftest import IN, expected_output, write_linear_model

pytestmark = pytest.mark.slow

FLEET = [Node("node-a", 8000, 65536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2)))]


class CloudThread:
    """A Cloud on its own event loop in a background thread, so tests can use blocking clients."""

    def __init__(self, config: CloudConfig, backend: str = "local") -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cloud = self._run(self._make(config))
        self._run(self.cloud.start())
        self.url = f"http://127.0.0.1:{self.cloud.http_port}"
        self.key = (config.state_dir / "admin.key").read_text().strip()  # as `octacloud up` users find it
        self.auth = {"Authorization": f"Bearer {self.key}"}

    async def _make(self, config: CloudConfig) -> Cloud:
        if self.backend == "ray":
            return ray_cloud(config, cache_root=config.state_dir / "node-cache")
        return Cloud(config, nodes=FLEET)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self, stop_replicas: bool) -> None:
        self._run(self.cloud.stop(stop_replicas=stop_replicas))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()  # else its self-pipe leaks, and pytest reports the unclosed loop

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin{path}", json=body, headers=self.auth, timeout=30)

    def deployment(self, name: str) -> dict[str, Any]:
        response = self.admin("GET", f"/deployments/{name}")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 90.0, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def ready_ids(c: CloudThread, name: str) -> set[str]:
    return {r["id"] for r in c.deployment(name)["instances"] if r["state"] == "ready"}


def config(tmp_path: Path, repo: Path) -> CloudConfig:
    return CloudConfig(
        repository=repo,
        state_dir=tmp_path / "var",
        http_port=0,
        grpc_port=0,
        controller=ControllerSettings(interval_s=0.5, health_interval_s=0.2, backoff_base_s=0.2, stop_grace_s=3),
    )


def stall_config(tmp_path: Path, **limits: Any) -> CloudConfig:
    """``config`` for the linear model, with a controller that never replaces a stalled replica during a test (only
    the gateway reacts) and these gateway limits changed."""
    write_linear_model(tmp_path / "models")
    cfg = config(tmp_path, tmp_path / "models")
    cfg.controller = replace(cfg.controller, probe_failures_to_fail=1000, probe_timeout_s=0.2)
    cfg.limits = replace(cfg.limits, **limits)
    return cfg


@pytest.fixture(scope="module")
def ray_fleet() -> Iterator[None]:
    """FLEET as a one-node Ray cluster (started once per module, only when a test runs on Ray)."""
    from octacloud.control.ray.local import LocalRayCluster

    temp = Path(f"/tmp/octacloud-ray-{os.getpid()}")  # Ray's socket paths must stay short: not under tmp_path
    with LocalRayCluster(FLEET, temp_dir=temp):
        yield
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(params=["local", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_fleet")
    return str(request.param)


@pytest.fixture
def cloud(tmp_path: Path, linear_repo: Path, backend: str) -> Iterator[CloudThread]:
    c = CloudThread(config(tmp_path, linear_repo), backend)
    yield c
    c.stop(stop_replicas=True)


def infer_http(url: str, model: str, x: np.ndarray, key: str) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=30)
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out: np.ndarray = client.infer(model, [inp], headers={"Authorization": f"Bearer {key}"}).as_numpy("OUTPUT0")
    client.close()
    return out


def replaced(c: CloudThread, old: dict[str, Any]) -> bool:
    now = {r["id"]: r for r in c.deployment("linear")["instances"]}
    r = now[old["id"]]
    return r["state"] == "ready" and r["pid"] not in (None, old["pid"]) and len(ready_ids(c, "linear")) == 2


def replica_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_deploy_infer_scale_fail_restart_undeploy(tmp_path: Path, linear_repo: Path, cloud: CloudThread) -> None:
    import tritonclient.grpc as grpcclient

    # deploy: two replicas of two octants each, placed by the scheduler
    created = cloud.admin("POST", "/deployments", {"name": "linear", "model": "linear", "octants": 2,
                                                    "min_replicas": 1, "max_replicas": 4})  # fmt: skip
    assert created.status_code == 201, created.text
    assert cloud.admin("POST", "/deployments/linear/scale", {"replicas": 2}).status_code == 200
    wait_until("two ready replicas", lambda: len(ready_ids(cloud, "linear")) == 2)

    # the placement is the scheduler's, and each replica process saw its slice
    state = cloud.cloud.state
    for r in cloud.deployment("linear")["instances"]:
        placement = state.allocations[r["id"]].placement
        assert (r["node"], tuple(r["gpus"]), r["milli_per_gpu"]) == (placement.node, placement.gpus, 250)
        assert r["host"] == "127.0.0.1" and r["handle"]  # where the gateway reaches it, how the launcher knows it
        env = replica_env(r["pid"])
        assert env["OCTACLOUD_SLICE"] == f"node-a/gpu{r['gpus'][0]}@250m"
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OCTACLOUD_THREADS"] == "1"
    assert state.allocated_gpu_milli == 500

    # inference through the gateway, REST (binary tensors) and gRPC
    x = np.random.default_rng(0).standard_normal((3, IN)).astype(np.float32)
    np.testing.assert_allclose(infer_http(cloud.url, "linear", x, cloud.key), expected_output(x), rtol=1e-5, atol=1e-5)
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{cloud.cloud.grpc_port}")
    ginp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    ginp.set_data_from_numpy(x)
    meta = {"authorization": f"Bearer {cloud.key}"}
    out = g.infer("linear", [ginp], headers=meta).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, expected_output(x), rtol=1e-5, atol=1e-5)
    assert g.is_model_ready("linear", headers=meta)

    # statistics through the gateway are the deployment's: the sum over its replicas, REST and gRPC (asked of the
    # replicas themselves with the cloud's internal secret: without it they answer 401; on Ray over internal TLS)
    internal = {HEADER: cloud.cloud.internal_secret}
    tls = cloud.cloud.internal_tls
    scheme, verify = ("https", tls) if tls is not None else ("http", True)
    assert (tls is not None) == (cloud.backend == "ray")  # internal TLS is on by default on Ray only
    per_replica = [
        httpx.get(
            f"{scheme}://127.0.0.1:{r['http_port']}/v2/models/linear/stats", headers=internal, verify=verify
        ).json()["model_stats"][0]
        for r in cloud.deployment("linear")["instances"]
    ]
    total = sum(int(s["inference_count"]) for s in per_replica)
    assert total == 6  # two requests of three rows, wherever they landed
    rest_stats = httpx.get(f"{cloud.url}/v2/models/linear/stats", headers=cloud.auth).json()["model_stats"]
    assert [int(s["inference_count"]) for s in rest_stats] == [total]
    assert int(rest_stats[0]["inference_stats"]["success"]["count"]) == 2
    grpc_stats = g.get_inference_statistics("linear", headers=meta, as_json=True)["model_stats"]
    assert [int(s["inference_count"]) for s in grpc_stats] == [total]
    unknown = httpx.get(f"{cloud.url}/v2/models/linear/versions/9/stats", headers=cloud.auth)
    assert unknown.status_code >= 400 and "9" in unknown.text
    g.close()
    assert httpx.get(f"{cloud.url}/v2/models/nope/ready", headers=cloud.auth).status_code == 404

    # kill -9 one replica under load: nothing hangs, failures are clear, and it is replaced
    victim = cloud.deployment("linear")["instances"][0]
    stop_load = threading.Event()
    outcomes: list[str] = []

    def load() -> None:
        while not stop_load.is_set():
            try:
                out = infer_http(cloud.url, "linear", x, cloud.key)
                np.testing.assert_allclose(out, expected_output(x), rtol=1e-5, atol=1e-5)
                outcomes.append("ok")
            except Exception as exc:  # the client surfaces the gateway's error text
                outcomes.append(f"error: {exc}")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load) for _ in range(4)]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until("the killed replica to be replaced", lambda: replaced(cloud, victim), timeout=60)
        time.sleep(0.5)
        stop_load.set()
        for f in futures:
            f.result(timeout=60)  # no request hangs
    errors = [o for o in outcomes if o != "ok"]
    assert outcomes.count("ok") > 20
    assert all("replica" in e or "no ready replica" in e for e in errors), errors[:3]
    after = {r["id"]: r for r in cloud.deployment("linear")["instances"]}
    assert after[victim["id"]]["pid"] != victim["pid"] and after[victim["id"]]["restarts"] == 1

    # scale up and down; slices follow
    assert cloud.admin("POST", "/deployments/linear/scale", {"replicas": 3}).status_code == 200
    wait_until("three ready replicas", lambda: len(ready_ids(cloud, "linear")) == 3)
    assert cloud.cloud.state.allocated_gpu_milli == 750
    assert cloud.admin("POST", "/deployments/linear/scale", {"replicas": 9}).status_code == 400
    assert cloud.admin("POST", "/deployments/linear/scale", {"replicas": 1}).status_code == 200
    wait_until("one replica", lambda: len(cloud.deployment("linear")["instances"]) == 1)
    assert cloud.cloud.state.allocated_gpu_milli == 250

    # restart the controller: the deployment comes back and the running replica is adopted, not relaunched
    before = cloud.deployment("linear")["instances"][0]
    cloud.stop(stop_replicas=False)
    again = CloudThread(config(tmp_path, linear_repo), cloud.backend)
    try:
        wait_until("the adopted replica to serve", lambda: len(ready_ids(again, "linear")) == 1)
        assert again.deployment("linear")["instances"][0]["pid"] == before["pid"]
        np.testing.assert_allclose(
            infer_http(again.url, "linear", x, again.key), expected_output(x), rtol=1e-5, atol=1e-5
        )
        assert again.cloud.state.allocated_gpu_milli == 250

        # undeploy: replicas stop and their slices return to the pool
        assert again.admin("DELETE", "/deployments/linear").status_code == 200
        wait_until(
            "the slice to return (after the drained replica stopped)",
            lambda: again.cloud.state.allocated_gpu_milli == 0,
        )
        wait_until("the replica process to exit", lambda: not _alive(before["pid"]), timeout=15)
    finally:
        again.stop(stop_replicas=True)
    cloud.thread = threading.Thread()  # the fixture's cloud is already stopped
    cloud.stop = lambda stop_replicas: None  # type: ignore[method-assign]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def test_higher_priority_preempts_and_victim_returns(cloud: CloudThread) -> None:
    # fill what normal work may take (80 % of 2 cards: the rest is failover headroom) with low-priority work
    low = {"name": "low", "model": "linear", "octants": 6, "min_replicas": 2, "max_replicas": 2, "priority": 0}
    assert cloud.admin("POST", "/deployments", low).status_code == 201
    wait_until("low to fill the fleet", lambda: len(ready_ids(cloud, "low")) == 2)
    assert cloud.cloud.state.allocated_gpu_milli == 1500

    high = {"name": "high", "model": "linear", "octants": 4, "priority": 10}
    assert cloud.admin("POST", "/deployments", high).status_code == 201
    wait_until("high to preempt low", lambda: len(ready_ids(cloud, "high")) == 1)
    states = [r["state"] for r in cloud.deployment("low")["instances"]]
    assert states.count("pending") == 1, states
    x = np.ones((1, IN), np.float32)
    np.testing.assert_allclose(infer_http(cloud.url, "high", x, cloud.key), expected_output(x), rtol=1e-5, atol=1e-5)

    # when room returns, the victim is placed again
    assert cloud.admin("DELETE", "/deployments/high").status_code == 200
    wait_until("the victim to come back", lambda: len(ready_ids(cloud, "low")) == 2)


def test_bad_deployments_are_refused_and_nothing_is_lost(cloud: CloudThread) -> None:
    ok = cloud.admin("POST", "/deployments", {"name": "keep", "model": "linear"})
    assert ok.status_code == 201
    cases = [
        ({"name": "x", "model": "missing"}, 404, "not in the repository"),
        ({"name": "Bad Name", "model": "linear"}, 400, "lowercase"),
        ({"name": "x", "model": "linear", "octants": 12}, 400, "multiple of 8"),
        ({"name": "x", "model": "linear", "gpus": 1}, 400, "unknown deployment field"),
    ]
    for body, status, message in cases:
        response = cloud.admin("POST", "/deployments", body)
        assert response.status_code == status and message in response.json()["error"], response.text
    assert cloud.admin("POST", "/deployments/nope/scale", {"replicas": 1}).status_code == 404
    assert cloud.admin("POST", "/deployments/keep/scale", {"replicas": "two"}).status_code == 400
    names = [d["spec"]["name"] for d in cloud.admin("GET", "/deployments").json()["deployments"]]
    assert names == ["keep"]
