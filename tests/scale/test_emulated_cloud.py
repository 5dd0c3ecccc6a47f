"""An emulated fleet, end to end: the real cloud (controller, store, gateway) over emulated replicas.

One cloud for the module, on a generated fleet of 4 nodes × 2 cards, its replicas in 2 replica host processes.
Each emulated replica must behave as a real one to everything around it: it serves REST and gRPC through the
gateway (zeros of the declared shapes), refuses callers without the cloud's secret and requests meant for
another replica, keeps its health endpoints open, and exports metrics behind the secret. A host killed with
``kill -9`` takes its replicas with it; the controller restarts them, nothing placed twice. A restarted
controller adopts the replicas that still run, with no restart.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from octacloud.app import CloudConfig
from octacloud.control.controller import ControllerSettings
from octacloud.control.emulated import EmulatedLauncher, EmulationSettings, parse_handle
from octacloud.control.fleet_gen import FleetShape, generated_fleet
from octacloud.security.internal_auth import HEADER, REPLICA_HEADER
from octacloud.serving.emulated import EmulatedLatency

from ..dashboard.conftest import CloudThread, wait_until

pytestmark = pytest.mark.slow

CONFIG = (
    'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
)
FLEET = generated_fleet(FleetShape(nodes=4, cards=2, racks=2))
BODY = {"inputs": [{"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 8}]}


def write_model(repo: Path, name: str) -> None:
    """A model folder an emulated replica serves: a config with its tensors, a version folder, no model file."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.replace("{name}", name))


def config_for(root: Path) -> CloudConfig:
    return CloudConfig(
        repository=root / "models",
        state_dir=root / "var",
        http_port=0,
        grpc_port=0,
        controller=ControllerSettings(interval_s=0.5, health_interval_s=0.2, backoff_base_s=0.2, stop_grace_s=2),
        emulation=EmulationSettings(EmulatedLatency(1.0), hosts=2, idle_exit_s=5.0),
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("emulated")
    write_model(root / "models", "lin")
    write_model(root / "models", "rank")
    yield root
    EmulatedLauncher(root / "var" / "replicas").stop_hosts()


@pytest.fixture(scope="module")
def cloud(root: Path) -> Iterator[CloudThread]:
    c = CloudThread(config_for(root), FLEET)
    for body in (
        {"name": "lin", "model": "lin", "octants": 2, "min_replicas": 5, "max_replicas": 5},
        {"name": "rank", "model": "rank", "octants": 8, "min_replicas": 2, "max_replicas": 2},
    ):
        assert c.post("/admin/deployments", body).status_code == 201
    wait_until("7 ready replicas", lambda: len(ready(c)) == 7, timeout=60)
    yield c
    if c.cloud._started:
        c.stop()
    else:  # stopped by the restart test, which stopped the replicas with the second cloud
        c.loop.call_soon_threadsafe(c.loop.stop)
        c.thread.join(timeout=10)
        c.loop.close()


def ready(c: CloudThread) -> list[dict[str, Any]]:
    rows = [r for d in c.get("/admin/deployments").json()["deployments"] for r in d["instances"]]
    return [r for r in rows if r["state"] == "ready"]


def test_emulated_replicas_answer_through_the_gateway(cloud: CloudThread) -> None:
    r = httpx.post(f"{cloud.url}/v2/models/lin/infer", json=BODY, headers=cloud.auth, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [2, 3] and out["data"] == [0.0] * 6
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cloud.cloud.grpc_port}")
    x = grpcclient.InferInput("INPUT0", [3, 4], "FP32")
    x.set_data_from_numpy(np.ones((3, 4), np.float32))
    answer = client.infer("rank", [x], headers={"authorization": f"Bearer {cloud.key}"})
    assert answer.as_numpy("OUTPUT0").tolist() == np.zeros((3, 3)).tolist()
    client.close()


def test_emulated_replicas_keep_a_replicas_checks(cloud: CloudThread) -> None:
    secret = cloud.cloud.internal_secret
    replica = next(r for r in ready(cloud) if r["id"].startswith("lin-"))
    other = next(r for r in ready(cloud) if r["id"] != replica["id"])
    base = f"http://127.0.0.1:{replica['http_port']}"
    infer = f"{base}/v2/models/lin/infer"
    assert httpx.post(infer, json=BODY, timeout=10).status_code == 401  # no secret
    assert httpx.post(infer, json=BODY, headers={HEADER: "x" * 40}, timeout=10).status_code == 401
    misdirected = {HEADER: secret, REPLICA_HEADER: str(other["id"])}
    assert httpx.post(infer, json=BODY, headers=misdirected, timeout=10).status_code == 421
    mine = {HEADER: secret, REPLICA_HEADER: str(replica["id"])}
    assert httpx.post(infer, json=BODY, headers=mine, timeout=10).status_code == 200
    assert httpx.get(f"{base}/v2/health/ready", timeout=10).status_code == 200  # health stays open
    metrics = f"http://127.0.0.1:{replica['metrics_port']}/metrics"
    assert httpx.get(metrics, timeout=10).status_code == 401
    assert httpx.get(metrics, headers={HEADER: secret, REPLICA_HEADER: str(other["id"])}, timeout=10).status_code == 421
    text = httpx.get(metrics, headers=mine, timeout=10).text
    assert 'nv_inference_request_success{model="lin",version="1"}' in text


def test_kill_9_of_a_replica_host_restarts_its_replicas(cloud: CloudThread) -> None:
    launcher = cloud.cloud.controller.launcher
    assert isinstance(launcher, EmulatedLauncher)
    before = {str(r["id"]): str(r["handle"]) for r in ready(cloud)}
    host, pid = next(iter(launcher.host_pids().items()))
    lost = {rid for rid, handle in before.items() if parse_handle(handle)[0] == host}
    assert lost, "no replica on the host chosen"
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        rows = ready(cloud)
        restarted = {str(r["id"]) for r in rows if r["restarts"]}
        return len(rows) == 7 and lost <= restarted

    wait_until("the lost host's replicas to restart", back, timeout=60)
    assert pid not in launcher.host_pids().values()
    held: dict[tuple[str, int], int] = {}
    for row in ready(cloud):
        for g in row["gpus"]:
            held[(row["node"], g)] = held.get((row["node"], g), 0) + row["milli_per_gpu"]
    assert all(milli <= 1000 for milli in held.values())  # nothing placed twice
    answer = httpx.post(f"{cloud.url}/v2/models/lin/infer", json=BODY, headers=cloud.auth, timeout=10)
    assert answer.status_code == 200


def test_a_restarted_controller_adopts_emulated_replicas(root: Path, cloud: CloudThread) -> None:
    before = {str(r["id"]): (r["handle"], r["http_port"]) for r in ready(cloud)}
    cloud.cloud.request_stop()
    cloud._run(cloud.cloud.stop())  # replicas keep running, as after Ctrl-C
    again = CloudThread(config_for(root), FLEET)
    try:
        wait_until("the adopted replicas to be ready", lambda: len(ready(again)) == 7, timeout=30)
        after = {str(r["id"]): (r["handle"], r["http_port"]) for r in ready(again)}
        assert after == before
        r = httpx.post(f"{again.url}/v2/models/lin/infer", json=BODY, headers=again.auth, timeout=10)
        assert r.status_code == 200
    finally:
        again.stop()
