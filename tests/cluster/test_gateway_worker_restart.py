"""The gateway apart from the controller: with one gateway worker process (``octacloud up``'s default), a worker
killed with -9, or one that passes its memory bound (``worker_max_rss_mib``) under a tenant's partial gRPC
messages, is restarted while the controller's loop keeps completing passes, and another tenant's REST and gRPC
traffic is answered again once the new worker serves.

The order of events is what is checked: the kill (or the watchdog's), then controller passes, then the new
worker serving, then the other tenant's calls answered."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from octacloud.gateway.workers import OOM_SCORE_ADJ, GatewayWorkers, resident_bytes
from tests import h2wire
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import config, wait_until
from tests.security.test_gateway_h2_headers import INFER, Setup, victim_and_attacker

pytestmark = pytest.mark.slow

MIB = 2**20
BOUND_MIB = 320
"""The worker's memory bound here: some 200 MiB above what a worker uses once it serves."""
X = np.arange(2 * IN, dtype=np.float32).reshape(2, IN) / 10


class Events:
    """What happened, in order: controller passes, the workers' events, what the test saw."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.log.append(what)

    def between(self, first: str, then: str) -> list[str]:
        with self._lock:
            log = list(self.log)
        start = next(i for i, e in enumerate(log) if e.startswith(first))
        end = next(i for i, e in enumerate(log) if i > start and e.startswith(then))
        return log[start + 1 : end]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Setup, Events]]:
    root = tmp_path_factory.mktemp("worker-restart")
    write_linear_model(root / "models")
    cfg = config(root, root / "models")
    cfg.gateway_workers = 1
    # a front that would hold far more than its worker may use: the memory bound is what stops it
    cfg.limits = replace(
        cfg.limits,
        max_inflight_per_replica=64,
        max_message_bytes=256 * MIB,
        grpc_unfinished_bytes_per_connection=260 * MIB,
        grpc_unfinished_bytes_per_tenant=1024 * MIB,
        worker_max_rss_mib=BOUND_MIB,
    )
    events = Events()
    with victim_and_attacker(cfg) as s:
        cloud = s.cloud.cloud
        _record_passes(cloud.controller, events)
        workers = _workers(s)
        told = workers.on_event

        def seen(message: str) -> None:
            events.add(f"worker: {message}")
            told(message)

        workers.on_event = seen
        yield s, events


def _record_passes(controller: Any, events: Events) -> None:
    for name in ("reconcile", "check_health"):
        original = getattr(controller, name)

        async def recorded(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            result = await _original(*args, **kwargs)
            events.add("pass")
            return result

        setattr(controller, name, recorded)


def _workers(s: Setup) -> GatewayWorkers:
    workers: GatewayWorkers | None = s.cloud.cloud.gateway_workers
    assert workers is not None, "the cloud runs its gateway in a worker process"
    return workers


def victim_answered(s: Setup) -> bool:
    """One REST and one gRPC inference of the victim's, on fresh connections: both answered correctly."""
    headers = {"Authorization": f"Bearer {s.victim}"}
    body = {"inputs": [{"name": "INPUT0", "shape": [2, IN], "datatype": "FP32", "data": X.ravel().tolist()}]}
    try:
        r = httpx.post(f"{s.cloud.url}/v2/models/v-lin/infer", json=body, headers=headers, timeout=30)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        try:
            tensor = grpcclient.InferInput("INPUT0", [2, IN], "FP32")
            tensor.set_data_from_numpy(X)
            out = client.infer("v-lin", [tensor], headers={"authorization": f"Bearer {s.victim}"})
        finally:
            client.close()
    except Exception:
        return False
    return r.status_code == 200 and np.allclose(out.as_numpy("OUTPUT0"), expected_output(X), rtol=1e-5)


def restarted(s: Setup, events: Events, before: int) -> None:
    """Wait for a new worker (not pid ``before``) to serve, and record it."""
    workers = _workers(s)
    wait_until("the worker restarted", lambda: workers.pids().get(0) not in (None, before) and workers.serving() == {0})
    events.add("serving again")


def assert_recovered(s: Setup, events: Events, cause: str) -> None:
    """Controller passes between ``cause`` and the new worker serving, and the victim answered after it."""
    during = events.between(cause, "serving again")
    assert during.count("pass") >= 1, during
    wait_until("the victim's calls answered again", lambda: victim_answered(s), timeout=30)
    assert all(victim_answered(s) for _ in range(5))
    ready = httpx.get(f"{s.cloud.url}/v2/health/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    assert s.cloud.cloud.controller.loop_health.failures == 0


def test_a_worker_killed_with_9_is_restarted_while_the_controller_runs(setup: tuple[Setup, Events]) -> None:
    s, events = setup
    workers = _workers(s)
    assert victim_answered(s)
    assert os.getpid() != workers.pids()[0]  # the fronts are not in the controller's process
    victim = workers.pids()[0]
    with open(f"/proc/{victim}/oom_score_adj") as f:
        assert int(f.read()) == OOM_SCORE_ADJ  # out of memory, the kernel picks the worker before the controller
    restarts = workers.restarts
    events.add("kill -9")
    os.kill(victim, signal.SIGKILL)
    restarted(s, events, victim)
    assert_recovered(s, events, "kill -9")
    assert workers.restarts == restarts + 1
    assert any("gateway worker 0 exited (code -9" in e for e in events.log), events.log


def test_a_worker_past_its_memory_bound_is_killed_and_restarted(setup: tuple[Setup, Events]) -> None:
    """The attacker's partial messages (three calls announcing 250 MiB each, up to 240 MiB of each sent) are
    within the front's own bounds here, and past the worker's: the main process kills it at its bound."""
    s, events = setup
    workers = _workers(s)
    assert victim_answered(s)
    victim = workers.pids()[0]
    used = resident_bytes(victim)
    assert used is not None and used < (BOUND_MIB - 128) * MIB, f"a serving worker uses {used} bytes"
    kills = workers.memory_kills
    key = ("authorization", f"Bearer {s.attacker}")

    async def partial() -> int:
        wire = await h2wire.H2Wire.open(s.grpc_port)
        sent = 0
        try:
            wire.writer.write(h2wire.header_frames(1, h2wire.grpc_headers(INFER, [key])))
            wire.writer.write(h2wire.frame(h2wire.DATA, 0, 1, b"\x00" + struct.pack(">I", 250 * MIB)))
            chunk = h2wire.frame(h2wire.DATA, 0, 1, b"\x00" * 16384) * 64  # 1 MiB of DATA frames a write
            for _ in range(240):
                wire.writer.write(chunk)
                await asyncio.wait_for(wire.writer.drain(), 30)
                sent += 1
        except (ConnectionError, TimeoutError):
            pass
        finally:
            wire.close()
        return sent

    async def attack() -> list[int]:
        return list(await asyncio.gather(partial(), partial(), partial()))

    sent = asyncio.run(attack())
    restarted(s, events, victim)
    assert workers.memory_kills == kills + 1, events.log
    cause = "worker: gateway worker 0 used"
    assert any(e.startswith(cause) and f"over its bound of {BOUND_MIB} MiB" in e for e in events.log), events.log
    assert sum(sent) < 3 * 240, sent  # cut: the worker was killed before it had taken it all
    assert_recovered(s, events, cause)
    print(f"a worker serving used {used / MIB:.0f} MiB; the attacker sent {sum(sent)} MiB before the kill")
