"""The cloud on a Ray cluster of three fake 8-card nodes (one machine, loopback-only namespace).

Placement is octacloud's scheduler's (the ``spread`` policy here, so that replicas land on every node); Ray
runs each replica as an actor pinned to the chosen node holding exactly its card's octants. Checked: the
replica runs on that node and card with the slice environment (read from inside the actor); the gateway
reaches replicas on every node; a node whose raylet is killed has its replicas re-placed on the others and
served again within 15 s, with requests in flight retried or failed clearly; a node that joins is used
without a restart.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from octacloud.control.ray.local import LocalRayCluster
from octacloud.core import Gpu, Node
from octacloud.idlespin import REPLICA_SPIN_ENV
from octacloud.security.internal_auth import HEADER

from ..cluster.conftest import IN, expected_output, write_linear_model
from .harness import CloudThread, fast_config, ray_cloud, wait_until

pytestmark = pytest.mark.slow

CARD = "FAKE-A100"


def fake_node(name: str) -> Node:
    """An 8-card server whose "cards" are fake (replicas compute on the CPU) and one CPU core."""
    return Node(name, 1000, 8192, tuple(Gpu(i, CARD, 16384) for i in range(8)))


NODES = [fake_node("ray-a"), fake_node("ray-b"), fake_node("ray-c")]
REPLICAS = 3


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    temp = Path(f"/tmp/octacloud-ray-{os.getpid()}")  # Ray's socket paths must stay short: not under tmp_path
    cluster = LocalRayCluster(NODES, temp_dir=temp)
    yield cluster
    cluster.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cloud(ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    root = tmp_path_factory.mktemp("raycloud")
    write_linear_model(root / "shared-models")
    config = fast_config(root / "var", root / "shared-models", policy="spread")
    saved = os.environ.get(REPLICA_SPIN_ENV)
    os.environ[REPLICA_SPIN_ENV] = "40"  # the cloud's, forwarded to its actors (Ray's workers started without it)
    c = CloudThread(lambda: ray_cloud(config, cache_root=root / "node-cache"))
    created = c.admin("POST", "/deployments", {"name": "linear", "model": "linear", "octants": 2,
                                               "min_replicas": REPLICAS, "max_replicas": REPLICAS})  # fmt: skip
    assert created.status_code == 201, created.text
    wait_until("three ready replicas", lambda: len(c.ready("linear")) == REPLICAS, timeout=120)
    yield c
    c.stop(stop_replicas=True)
    if saved is None:
        os.environ.pop(REPLICA_SPIN_ENV, None)
    else:
        os.environ[REPLICA_SPIN_ENV] = saved


def replica_stats(cloud: CloudThread, replica_id: str) -> int:
    """Inferences this replica served, asked of the replica itself (not through the gateway)."""
    r = next(r for r in cloud.cloud.store.replicas() if r.id == replica_id)
    url = f"https://{r.host}:{r.http_port}/v2/models/linear/stats"  # internal TLS: on by default on Ray
    internal = {HEADER: cloud.cloud.internal_secret}  # replicas answer their own cloud only
    verify = cloud.cloud.internal_tls  # the cloud's CA, and the cloud's client certificate
    assert verify is not None
    stats = httpx.get(url, headers=internal, timeout=10, verify=verify).json()["model_stats"]
    return sum(int(s["inference_count"]) for s in stats)


def test_replicas_run_where_the_scheduler_placed_them(cloud: CloudThread) -> None:
    launcher = cloud.cloud.controller.launcher
    fleet = launcher.fleet  # type: ignore[attr-defined]
    state = cloud.cloud.state
    replicas = cloud.cloud.store.replicas("linear")
    assert {r.node for r in replicas} == {"ray-a", "ray-b", "ray-c"}  # spread: one per node
    for r in replicas:
        placement = state.allocations[r.id].placement
        assert (r.node, r.gpus, r.milli_per_gpu) == (placement.node, placement.gpus, 250)
        inside = launcher.placement(r.handle)  # type: ignore[attr-defined]
        card = r.gpus[0]
        assert inside["node_id"] == fleet.node_id(r.node)
        assert inside["resources"] == {f"gpu{card}_octant": 2.0}
        env = inside["env"]
        assert env["OCTACLOUD_SLICE"] == f"{r.node}/gpu{card}@250m"
        assert env["CUDA_VISIBLE_DEVICES"] == str(card)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert env["OCTACLOUD_THREADS"] == "1" and env["OCTACLOUD_REPLICA_ID"] == r.id
        assert env[REPLICA_SPIN_ENV] == "40"  # forwarded from the cloud's environment
        secret_file = Path(env["OCTACLOUD_INTERNAL_SECRET_FILE"])  # the cloud's internal secret, private to the node
        assert secret_file.stat().st_mode & 0o777 == 0o600
        assert secret_file.read_text().strip() == cloud.cloud.internal_secret
        assert inside["pid"] == r.pid
    assert state.allocated_gpu_milli == REPLICAS * 250

    # a restarted controller (a new launcher) finds each replica by its handle and learns where it serves
    from octacloud.control.ray.backend import RayLauncher

    fresh = RayLauncher(fleet, launcher.storage, launcher.cache_root)  # type: ignore[attr-defined]
    for r in replicas:
        assert fresh.alive(r.handle)
        wait_until("the adopted replica's address", lambda r=r: fresh.address(r.handle) is not None, timeout=30)
        address = fresh.address(r.handle)
        assert address is not None and (address.host, address.http_port, address.pid) == (r.host, r.http_port, r.pid)
        assert address.note == ""  # its cache outcome was recorded when it started

    # every node's model cache missed once (first copy from the shared repository)
    stats = launcher.cache_stats.snapshot()  # type: ignore[attr-defined]
    assert {n: (s.hits, s.misses) for n, s in stats.items()} == {n.name: (0, 1) for n in NODES}
    assert any("model cache miss on ray-b" in e["message"] for e in cloud.cloud.store.events(200))
    # ... and the cloud's /metrics exports the same counts per node
    text = httpx.get(f"{cloud.url}/metrics", headers=cloud.headers, timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    misses = {
        s.labels["node"]: s.value for s in families["octacloud_model_cache_misses"].samples if s.name.endswith("_total")
    }
    assert misses == {n.name: 1.0 for n in NODES}


def test_gateway_reaches_replicas_on_every_node(cloud: CloudThread) -> None:
    x = np.random.default_rng(1).standard_normal((2, IN)).astype(np.float32)
    instances = cloud.ready("linear")
    before = {r["id"]: replica_stats(cloud, r["id"]) for r in instances}
    for _ in range(40):
        np.testing.assert_allclose(cloud.infer("linear", x), expected_output(x), rtol=1e-5, atol=1e-5)
    served = {r["node"]: replica_stats(cloud, r["id"]) - before[r["id"]] for r in instances}
    assert set(served) == {"ray-a", "ray-b", "ray-c"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == 40 * len(x)  # inference_count counts samples


def test_replicas_on_ray_serve_internal_tls_only(cloud: CloudThread) -> None:
    """Internal TLS is on by default on Ray: each replica has its own certificate (key mode 0600, handed over in
    the actor's start arguments), answers the cloud's client certificate and refuses plain text."""
    from cryptography import x509

    from octacloud.security.internal_tls import replica_server_name

    cache_root = cloud.cloud.controller.launcher.cache_root  # type: ignore[attr-defined]
    internal = {HEADER: cloud.cloud.internal_secret}
    for r in cloud.cloud.store.replicas("linear"):
        folder = cache_root / r.node / ".replicas" / r.id
        assert (folder / "replica.key").stat().st_mode & 0o777 == 0o600
        cert = x509.load_pem_x509_certificate((folder / "replica.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert replica_server_name(r.id) in names.get_values_for_type(x509.DNSName)
        assert r.host == "127.0.0.1"  # every node of this cluster is this machine: the gateway's node, loopback
        for port, path in ((r.http_port, "/v2/health/ready"), (r.metrics_port, "/metrics")):
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://{r.host}:{port}{path}", headers=internal, timeout=5)
            answer = httpx.get(
                f"https://{r.host}:{port}{path}", headers=internal, timeout=5, verify=cloud.cloud.internal_tls
            )
            assert answer.status_code == 200

    # past half its life, each replica's certificate is renewed in place (the actor rewrites its files; the
    # replica loads them for its next handshakes: tests/security/test_internal_tls.py)
    launcher = cloud.cloud.controller.launcher
    serials = {}
    for r in cloud.cloud.store.replicas("linear"):
        pem = cache_root / r.node / ".replicas" / r.id / "replica.pem"
        serials[r.id] = (pem, x509.load_pem_x509_certificate(pem.read_bytes()).serial_number)
    for issued in launcher._renewals._issued.values():  # type: ignore[attr-defined]
        issued.renew_at = 0.0
    assert cloud.call(launcher.renew_certificates) == REPLICAS  # type: ignore[attr-defined]
    wait_until(
        "renewed certificates on every node",
        lambda: all(x509.load_pem_x509_certificate(p.read_bytes()).serial_number != s for p, s in serials.values()),
        timeout=30,
    )


def test_a_lost_node_is_replaced_within_15_s(cloud: CloudThread, ray_cluster: LocalRayCluster) -> None:
    x = np.ones((1, IN), np.float32)
    victim = next(r for r in cloud.ready("linear") if r["node"] == "ray-c")
    stop_load = threading.Event()
    outcomes: list[str] = []

    def load() -> None:
        while not stop_load.is_set():
            try:
                np.testing.assert_allclose(cloud.infer("linear", x), expected_output(x), rtol=1e-5, atol=1e-5)
                outcomes.append("ok")
            except Exception as exc:  # the client surfaces the gateway's error text
                outcomes.append(f"error: {exc}")

    def replaced() -> bool:
        ready = cloud.ready("linear")
        return len(ready) == REPLICAS and all(r["node"] != "ray-c" for r in ready)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load) for _ in range(4)]
        time.sleep(0.5)
        ray_cluster.kill_node("ray-c")
        took = wait_until("the lost replica to be re-placed and ready", replaced, timeout=60)
        time.sleep(0.5)
        stop_load.set()
        for f in futures:
            f.result(timeout=60)  # no request hangs
    print(f"\nray-c's raylet killed: its replica re-placed and ready {took:.1f} s later")  # shown with -s

    errors = [o for o in outcomes if o != "ok"]
    assert outcomes.count("ok") > 20
    assert all("replica" in e for e in errors), errors[:3]
    again = next(r for r in cloud.ready("linear") if r["id"] == victim["id"])
    assert again["node"] in ("ray-a", "ray-b")
    placement = cloud.cloud.state.allocations[victim["id"]].placement
    assert (again["node"], tuple(again["gpus"])) == (placement.node, placement.gpus)
    np.testing.assert_allclose(cloud.infer("linear", x), expected_output(x), rtol=1e-5, atol=1e-5)
    kinds = [(e["kind"], e["subject"], e["message"]) for e in cloud.cloud.store.events(200)]
    assert ("node", "ray-c", "failed") in kinds
    # the model was already cached on the node it moved to: no copy
    assert any(k == "started" and s == victim["id"] and "cache hit" in m for k, s, m in kinds), kinds[:10]


def test_a_new_node_joins_without_restart(cloud: CloudThread, ray_cluster: LocalRayCluster) -> None:
    ray_cluster.add_node(fake_node("ray-d"))
    wait_until("ray-d in the fleet", lambda: "ray-d" in cloud.cloud.state.index, timeout=30)
    # spread puts a new replica on the emptiest node: the one that just joined
    body = {"name": "fresh", "model": "linear", "octants": 1}
    assert cloud.admin("POST", "/deployments", body).status_code == 201
    wait_until("the new replica to serve", lambda: len(cloud.ready("fresh")) == 1, timeout=60)
    assert cloud.ready("fresh")[0]["node"] == "ray-d"
    x = np.ones((1, IN), np.float32)
    np.testing.assert_allclose(cloud.infer("fresh", x), expected_output(x), rtol=1e-5, atol=1e-5)
    assert cloud.admin("DELETE", "/deployments/fresh").status_code == 200


def test_ray_refuses_what_our_accounting_would_overcommit(cloud: CloudThread, tmp_path: Path) -> None:
    from octacloud.control.launcher import LaunchSpec
    from octacloud.control.slices import Slice

    launcher = cloud.cloud.controller.launcher
    held = next(r for r in cloud.cloud.store.replicas("linear") if r.state.value == "ready")
    # a whole card where a running replica already holds 2 of its 8 octants: Ray must not start it
    s = Slice(held.node, held.gpus, 1000)
    spec = LaunchSpec("overcommit", "linear", tmp_path / "linear", "", {}, 1, s)
    launched = cloud.call(lambda: launcher.launch(spec))  # on the cloud's loop: the launcher is not thread-safe
    try:
        time.sleep(3.0)
        assert cloud.call(lambda: launcher.address(launched.handle)) is None  # waits for octants that are taken
        assert cloud.call(lambda: launcher.alive(launched.handle))
    finally:
        cloud.call(lambda: launcher.stop(launched.handle, 0.0))
