"""The state store locked by another process (a backup, an operator's sqlite3 shell, a slow disk) must not stall
the gateway that shares the controller's event loop (single-process mode): requests keep being answered while
the controller's writes wait for the lock, and what the controller decided meanwhile is stored once it is free."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import httpx

from octacloud.control.deployments import ReplicaState
from tests.cluster.controller_fakes import Harness
from tests.reliability.harness import gateway

HOLD_S = 3.0


def hold_write_lock(db: Path, held: threading.Event, seconds: float, released: list[float]) -> None:
    """Holds the database's write lock for ``seconds``; appends the perf_counter time just before it lets go."""
    c = sqlite3.connect(db, isolation_level=None)
    try:
        c.execute("BEGIN EXCLUSIVE")
        held.set()
        time.sleep(seconds)
        released.append(time.perf_counter())
        c.execute("COMMIT")
    finally:
        c.close()


def client(port: int, until: float, out: list[tuple[float, float, int]]) -> None:
    """POST in a loop until ``until`` (a perf_counter time), recording (sent at, latency, status)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            try:
                status = c.post("/v2/models/m/infer", content=b"ping").status_code
            except httpx.HTTPError:
                status = 0
            out.append((sent, time.perf_counter() - sent, status))
            time.sleep(0.01)


async def test_gateway_answers_while_another_connection_holds_the_store_lock(tmp_path: Path) -> None:
    gw = await gateway()
    h = Harness(tmp_path, interval_s=0.5, health_interval_s=0.02)
    h.routes = gw.routes  # one process: the controller routes through the gateway's table, on the same loop
    h.controller = h.make()
    h.controller.settings.health_interval_s = 0.02
    h.deploy("other", octants=2)
    stop = asyncio.Event()
    task = asyncio.create_task(h.controller.run(stop))
    try:
        for _ in range(300):
            await asyncio.sleep(0.01)
            if any(r.state is ReplicaState.READY for r in h.controller.store.replicas("other")):
                break
        (victim,) = h.controller.store.replicas("other")
        assert victim.state is ReplicaState.READY
        unlocked: list[tuple[float, float, int]] = []  # first, the same load with nothing holding the lock
        await asyncio.to_thread(client, gw.port, time.perf_counter() + 1.0, unlocked)
        held = threading.Event()
        released: list[float] = []
        locker = threading.Thread(target=hold_write_lock, args=(tmp_path / "state.db", held, HOLD_S, released))
        locker.start()
        await asyncio.to_thread(held.wait)
        locked_at = time.perf_counter()
        seen: list[tuple[float, float, int]] = []
        load = threading.Thread(target=client, args=(gw.port, locked_at + HOLD_S + 0.5, seen))
        load.start()
        await asyncio.sleep(0.2)
        h.launcher.crash(victim.id)  # the controller must record a failure: a write, blocked by the lock
        crashed_at = time.perf_counter()
        while load.is_alive():
            await asyncio.sleep(0.05)
        load.join()
        locker.join()
        # sent after the failure that the controller must write, and answered before the lock was let go
        (released_at,) = released
        answered = [x for x in seen if x[0] > crashed_at and x[0] + x[1] < released_at]
        print(f"{len(answered)} requests sent after the crash and answered while the store stayed locked")
        assert all(status == 200 for _, _, status in seen + unlocked)
        # (when the controller wrote on the event loop, nothing sent after its write began was answered before
        # the lock was let go: 4 answers in the 3 s, the last after 2.9 s)
        assert len(answered) >= 10
        assert h.store.replicas("other")[0].state is ReplicaState.FAILED  # decided at once, during the lock
        for _ in range(300):  # and stored once the lock is free
            await asyncio.sleep(0.01)
            if h.backing.replicas("other")[0].state is ReplicaState.FAILED:
                break
        assert h.backing.replicas("other")[0].state is ReplicaState.FAILED
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await gw.close()
