"""The gateway's latency preference on a real network: two racks as network namespaces joined to the gateway by
veth pairs, the far one behind ``tc netem`` delay, an ``octacloud serve`` replica in each. The gateway measures
each route over TCP, sends every request to the nearer replica while their loads are equal, reports the far
route (event and metric), and after the near replica is killed with ``kill -9`` sends everything to the far one
without a failed request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from octacloud.control.usage import parse_work
from octacloud.gateway.fronts import RestFront
from octacloud.gateway.latency import LATENCY_BUDGET_US, RouteLatency, TcpHandshake
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import Endpoint, Owner, RouteTable
from tests.cluster.conftest import IN, write_linear_model
from tests.cluster.racks import Rack, racks, run, skip_without_namespaces
from tests.serve_process import octacloud_executable

pytestmark = pytest.mark.slow

FAR_DELAY_US = 2_000
HTTP, GRPC, METRICS = 8000, 8001, 8002  # each rack has ports of its own


@contextmanager
def replica(rack: Rack, repo: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    argv = [octacloud_executable(), "serve", "--repository", str(repo), "--host", rack.address, "--http-port",
            str(HTTP), "--grpc-port", str(GRPC), "--metrics-port", str(METRICS), "--threads", "1"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(rack.inside(argv), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # a deadline against a hang, not a timing
        while True:
            try:
                if httpx.get(f"http://{rack.address}:{HTTP}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the replica in {rack.name} did not start: {log.read_text()}")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()  # nsenter execs the replica: this is its PID
        proc.wait(timeout=60)


def inferences(rack: Rack) -> int:
    return parse_work(httpx.get(f"http://{rack.address}:{METRICS}/metrics", timeout=10).text)[1]


def body(seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((1, IN)).astype(np.float32)
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()  # fmt: skip


async def send(port: int, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        return [
            (await client.post(f"http://127.0.0.1:{port}/v2/models/linear/infer", content=body(i))).status_code
            for i in range(n)  # one at a time: both replicas have nothing in flight at each choice
        ]


async def test_the_gateway_prefers_the_nearer_rack_and_reports_the_far_route(tmp_path: Path) -> None:
    skip_without_namespaces()
    before = run(["ip", "netns", "list"])
    repo = tmp_path / "models"
    write_linear_model(repo)
    events: list[tuple[str, str, str]] = []
    with ExitStack() as stack:
        near, far = stack.enter_context(racks([0, FAR_DELAY_US]))
        near_proc = stack.enter_context(replica(near, repo, tmp_path / "near.log"))
        stack.enter_context(replica(far, repo, tmp_path / "far.log"))
        table = RouteTable()
        table.update("linear", [Endpoint("linear-near", near.address, HTTP, GRPC),
                                Endpoint("linear-far", far.address, HTTP, GRPC)])  # fmt: skip
        table.owners["linear"] = Owner("t")
        latency = RouteLatency(
            table,
            TcpHandshake(tries=5),
            nodes=lambda: {"linear-near": "rack-1-node", "linear-far": "rack-2-node"},
            on_report=lambda *e: events.append(e),
        )
        await latency.measure()
        measured = dict(table.latency_us)
        assert measured["linear-far"] >= FAR_DELAY_US, measured  # the netem delay is in the handshake
        assert measured["linear-near"] < LATENCY_BUDGET_US < measured["linear-far"], measured
        assert [(d, r) for d, r, _ in events] == [("linear", "linear-far")]  # the far route, reported once
        assert latency.over == {"linear-far"}
        assert latency.node_latency_us()["rack-2-node"] == measured["linear-far"]

        limits = GatewayLimits()
        front = RestFront(RestGateway(table, limits=limits), limits)
        port = await front.start("127.0.0.1", 0, reuse_port=False)
        try:
            assert await send(port, 20) == [200] * 20
            assert (inferences(near), inferences(far)) == (20, 0)  # loads equal: the nearer one every time
            os.kill(near_proc.pid, signal.SIGKILL)  # kill -9 the near replica
            near_proc.wait(timeout=60)
            await latency.measure()  # its route no longer answers a handshake: no latency, not preferred
            assert set(table.latency_us) == {"linear-far"}
            assert await send(port, 10) == [200] * 10
            assert inferences(far) == 10
        finally:
            await front.stop(1)
    assert run(["ip", "netns", "list"]) == before  # every namespace made here is gone
    assert [line.split(":")[1].strip() for line in run(["ip", "-o", "link", "show"]).splitlines()] == ["lo"]
