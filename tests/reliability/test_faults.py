"""Faults against a real cloud: a replica that stalls is ejected, and taken back once it answers again (the
ejection expires; the controller's next successful probe ends it too); the gateway never answers for it in
the meantime with anything but a fast, clear refusal."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import IN, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until
from tests.security.conftest import call, make_tenant

pytestmark = pytest.mark.slow

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32", "data": [0.5] * IN}]}


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[CloudThread]:
    write_linear_model(tmp_path / "models")
    cfg = config(tmp_path, tmp_path / "models")
    # the controller must not replace the stalled replica during the test: only the gateway reacts
    cfg.controller = replace(cfg.controller, probe_failures_to_fail=1000, probe_timeout_s=0.2)
    c = CloudThread(cfg)
    yield c
    c.stop(stop_replicas=True)


def test_a_stalled_replica_is_ejected_then_serves_again(cloud: CloudThread) -> None:
    key = make_tenant(cloud, "a")
    assert call(cloud, key, "POST", "/admin/deployments", {"name": "lin", "model": "linear"}).status_code == 201
    wait_until("lin ready", lambda: bool(ready_ids(cloud, "lin")))
    [instance] = cloud.deployment("lin")["instances"]
    cloud.cloud.rest_gateway.request_timeout = 0.5
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{cloud.url}/v2/models/lin/infer"
    assert httpx.post(url, json=BODY, headers=headers, timeout=10).status_code == 200
    os.kill(instance["pid"], signal.SIGSTOP)
    try:
        for _ in range(3):  # three timeouts in a row: ejected
            assert httpx.post(url, json=BODY, headers=headers, timeout=10).status_code == 504
        started = time.monotonic()
        refused = httpx.post(url, json=BODY, headers=headers, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert time.monotonic() - started < 0.3  # refused at once, not after another timeout
        assert str(instance["http_port"]) not in refused.text
    finally:
        os.kill(instance["pid"], signal.SIGCONT)
    cloud.cloud.rest_gateway.request_timeout = 10
    deadline = time.monotonic() + 10
    while httpx.post(url, json=BODY, headers=headers, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the replica answers again but the gateway never routes to it"
        time.sleep(0.1)
    for _ in range(20):
        assert httpx.post(url, json=BODY, headers=headers, timeout=10).status_code == 200
    assert cloud.deployment("lin")["instances"][0]["pid"] == instance["pid"]  # the same replica, not a new one


def test_kill_9_of_a_replica_under_load_answers_every_request_cleanly(cloud: CloudThread) -> None:
    """Requests in flight on the killed replica are retried on the other; none hangs, none gets a 5xx other than
    a 503 with Retry-After, and no answer names a replica's address."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    key = make_tenant(cloud, "a")
    spec = {"name": "lin", "model": "linear", "min_replicas": 2, "max_replicas": 2}
    assert call(cloud, key, "POST", "/admin/deployments", spec).status_code == 201
    wait_until("two ready replicas", lambda: len(ready_ids(cloud, "lin")) == 2)
    instances = cloud.deployment("lin")["instances"]
    victim = instances[0]
    ports = {str(i["http_port"]) for i in instances}
    stop = threading.Event()
    outcomes: list[tuple[int, str, str | None]] = []

    def load() -> None:
        with httpx.Client(timeout=20) as client:
            while not stop.is_set():
                r = client.post(
                    f"{cloud.url}/v2/models/lin/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                )
                outcomes.append((r.status_code, r.text, r.headers.get("retry-after")))

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load) for _ in range(6)]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(2.0)
        stop.set()
        for f in futures:
            f.result(timeout=30)  # nothing hangs, no client error
    statuses = [s for s, _, _ in outcomes]
    assert statuses.count(200) > 20
    refused = [(s, text, retry) for s, text, retry in outcomes if s != 200]
    assert all(s == 503 and retry for s, _, retry in refused), refused[:3]
    assert not any(port in text for _, text, _ in refused for port in ports)
