"""The ledger against real traffic: a scripted two-tenant load through the gateway yields exactly the requests,
bytes and inferences that were sent; slices are billed allocation × time; ``kill -9`` of ``octacloud up``
loses no closed interval and double-counts none."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from octacloud.cli.cloud import as_typed
from octacloud.cli.main import app
from octacloud.control.store import StateStore
from octacloud.metering import Ledger, Metric
from tests.cluster.conftest import IN, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until
from tests.security.conftest import call, make_tenant

pytestmark = pytest.mark.slow

OCTACLOUD = as_typed("octacloud")
"""octacloud as up prints it (the cloud runs from this interpreter in the test's working folder)."""


def body(rows: int, seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((rows, IN)).astype(np.float32)
    inputs = [{"name": "INPUT0", "shape": [rows, IN], "datatype": "FP32", "data": x.ravel().tolist()}]
    return json.dumps({"inputs": inputs}).encode()


def send(url: str, key: str, deployment: str, rows: int, seed: int) -> tuple[int, int]:
    """One inference; returns (bytes sent, bytes received) of the HTTP bodies."""
    payload = body(rows, seed)
    response = httpx.post(
        f"{url}/v2/models/{deployment}/infer",
        content=payload,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return len(payload), len(response.content)


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[CloudThread]:
    repo = tmp_path / "models"
    write_linear_model(repo)
    cfg = config(tmp_path, repo)
    cfg.meter_interval_s = 1.0
    c = CloudThread(cfg)
    yield c
    c.stop(stop_replicas=True)


def usage(c: CloudThread, **params: str) -> dict[str, dict[str, float]]:
    data = call(c, c.key, "GET", "/admin/usage?" + "&".join(f"{k}={v}" for k, v in params.items())).json()
    return {f"{line['tenant']}/{line['group']}": line for line in data["lines"]}


def test_two_tenant_load_is_metered_exactly(metered: CloudThread) -> None:
    c = metered
    keys = {"acme": make_tenant(c, "acme"), "globex": make_tenant(c, "globex")}
    for tenant, octants in (("acme", 2), ("globex", 1)):
        spec = {"name": f"{tenant}-lin", "model": "linear", "octants": octants}
        assert call(c, keys[tenant], "POST", "/admin/deployments", spec).status_code == 201
    wait_until("both replicas", lambda: bool(ready_ids(c, "acme-lin") and ready_ids(c, "globex-lin")))

    sent = {t: {"requests": 0, "bytes_in": 0, "bytes_out": 0, "inferences": 0} for t in keys}
    for i in range(30):
        for tenant, n in (("acme", 2), ("globex", 1)):
            for j in range(n):
                rows = 1 + (i + j) % 4
                bytes_in, bytes_out = send(c.url, keys[tenant], f"{tenant}-lin", rows, seed=i * 10 + j)
                s = sent[tenant]
                s["requests"] += 1
                s["bytes_in"] += bytes_in
                s["bytes_out"] += bytes_out
                s["inferences"] += rows
    assert sent["acme"]["requests"] == 60 and sent["globex"]["requests"] == 30

    def metered_all() -> bool:
        # inferences come from the replicas' counters and requests and bytes from the gateway's, each read by the
        # meter in turn: the last request can land in one interval for one and in the next for the other
        lines = usage(c, by="tenant")
        return all({k: lines.get(f"{t}/", {}).get(k) for k in sent[t]} == sent[t] for t in keys)

    wait_until("the meter to close an interval after the load", metered_all, timeout=30)
    lines = usage(c, by="tenant")
    for tenant, s in sent.items():
        line = lines[f"{tenant}/"]
        assert {k: line[k] for k in s} == s, tenant
        assert line["exec_seconds"] > 0
        counted = c.cloud.routes.traffic[(tenant, f"{tenant}-lin")]  # reconciles with the gateway's counters
        assert (counted.requests, counted.bytes_in, counted.bytes_out) == (
            s["requests"],
            s["bytes_in"],
            s["bytes_out"],
        )

    # slices: every interval after the first holds exactly allocation × interval length
    records = Ledger(c.cloud.store.engine).records()
    for tenant, milli in (("acme", 250), ("globex", 125)):
        alloc = [r for r in records if r.metric is Metric.ALLOC and r.tenant == tenant]
        assert len(alloc) >= 2
        assert all(r.quantity == milli * r.interval_ms for r in alloc[1:-1] if r.interval_ms == 1000)
        assert 0 < alloc[0].quantity <= milli * alloc[0].interval_ms
        storage = [r for r in records if r.metric is Metric.STORAGE and r.tenant == tenant]
        assert storage and all(r.quantity > 0 for r in storage)
    keys_seen = [r.key for r in records]
    assert len(keys_seen) == len(set(keys_seen))

    # the same report through the CLI, as a tenant would read it
    runner = CliRunner()
    env = {"OCTACLOUD_URL": c.url, "OCTACLOUD_KEY": keys["globex"]}
    result = runner.invoke(app, ["usage", "--format", "csv"], env=env)
    assert result.exit_code == 0, result.output
    header, *rows = result.output.strip().splitlines()
    assert header.startswith("tenant,group,octant_seconds") and rows[0].startswith("globex,globex-lin,")
    assert all(not r.startswith("acme") for r in rows)
    assert f",{sent['globex']['requests']}," in rows[0]
    denied = runner.invoke(app, ["usage", "--tenant", "acme"], env=env)
    assert denied.exit_code == 1 and "no tenant named 'acme'" in denied.output


# ---- kill -9 of the whole cloud process -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class UpProcess:
    def __init__(self, repo: Path, state: Path, http: int, grpc: int, log: Path, extra: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "octacloud", "up", "--repository", str(repo), "--state-dir", str(state),
                "--http-port", str(http), "--grpc-port", str(grpc),
                "--interval", "0.5", "--meter-interval", "1", *extra]  # fmt: skip
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{http}"
        wait_until("octacloud up", self._ready, timeout=60)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def requests_in(ledger: Ledger) -> int:
    return sum(r.quantity for r in ledger.records() if r.metric is Metric.REQUESTS)


def test_kill_9_loses_no_closed_interval_and_double_counts_none(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_linear_model(repo)
    state = tmp_path / "var"
    http, grpc = free_port(), free_port()
    first = UpProcess(repo, state, http, grpc, tmp_path / "up1.log")
    admin = (state / "admin.key").read_text().strip()
    ledger = Ledger.at(f"sqlite:///{state / 'octacloud.db'}")
    try:
        h = {"Authorization": f"Bearer {admin}"}
        assert httpx.post(f"{first.url}/admin/tenants", json={"name": "acme"}, headers=h).status_code == 201
        key = httpx.post(f"{first.url}/admin/keys", json={"tenant": "acme"}, headers=h).json()["key"]
        spec = {"name": "lin", "model": "linear"}
        assert (
            httpx.post(
                f"{first.url}/admin/deployments", json=spec, headers={"Authorization": f"Bearer {key}"}
            ).status_code
            == 201
        )

        # readiness probes a replica answered are requests too; the gateway's own answers (503 while no replica
        # is ready, 404 while a gateway worker has not yet heard of the deployment) are not billed
        probes = 0

        def ready() -> bool:
            nonlocal probes
            r = httpx.get(f"{first.url}/v2/models/lin/ready", headers={"Authorization": f"Bearer {key}"})
            probes += r.status_code == 200
            return r.status_code == 200

        wait_until("the replica", ready, timeout=60)
        for i in range(20):
            send(first.url, key, "lin", 1, i)
        wait_until("every request in the ledger", lambda: requests_in(ledger) == 20 + probes, timeout=30)

        # load keeps running while the cloud dies
        attempted = 0
        stop = threading.Event()

        def load() -> None:
            nonlocal attempted
            while not stop.is_set():
                attempted += 1
                try:
                    send(first.url, key, "lin", 1, 1000 + attempted)
                except (httpx.HTTPError, AssertionError):
                    return

        worker = threading.Thread(target=load)
        worker.start()
        time.sleep(2.5)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        stop.set()
        worker.join(30)
        assert "admin API key (shown once" in first.log.read_text()

        before = ledger.records()
        closed = ledger.closed_until_ms()
        assert closed is not None
        counted_before = requests_in(ledger)
        assert 20 + probes < counted_before <= 20 + probes + attempted  # the closed intervals of the load are in
        assert max(r.interval_start_ms + r.interval_ms for r in before) == closed

        second = UpProcess(repo, state, http, grpc, tmp_path / "up2.log")
        probes = 0
        wait_until("the adopted replica", ready, timeout=60)
        for i in range(15):
            send(second.url, key, "lin", 2, 5000 + i)
        second.proc.send_signal(signal.SIGTERM)  # a graceful stop closes the open interval
        assert second.proc.wait(30) == 0, second.log.read_text()
        said = second.log.read_text()
        assert "admin API key" not in said  # shown once, on the first start only
        assert "adopted 1 running replica(s) (lin × 1)" in said, said  # what the restart found and kept
        assert f"1 replica(s) keep running (lin × 1): `{OCTACLOUD} up --state-dir {state}` adopts them" in said
        assert f"`{OCTACLOUD} down --state-dir {state}` stops them" in said

        after = ledger.records()
        assert after[: len(before)] == before  # closed intervals never rewritten
        assert len({r.key for r in after}) == len(after)
        assert requests_in(ledger) == counted_before + probes + 15  # after the restart: none lost, none twice
        assert min(r.interval_start_ms for r in after[len(before) :]) >= closed
        spans = sorted({(r.interval_start_ms, r.interval_start_ms + r.interval_ms) for r in after})
        assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans))
    finally:
        for p in (first.proc, *([second.proc] if "second" in locals() else [])):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        store = StateStore.at(state / "octacloud.db")
        for r in store.replicas():
            if r.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.pid, signal.SIGKILL)
        store.close()
        ledger.close()
