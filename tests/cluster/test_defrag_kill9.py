"""``kill -9`` of ``octacloud up`` in the middle of a live defragmentation move, with real replica processes:
the cloud started again over the same state finishes or rolls back the move, places the replica that fit
nowhere, and leaves exactly one serving replica per deployment — no orphaned process, no slice reserved twice —
and the deployments that stayed serve every request once the new gateway routes to them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from octacloud.control.store import StateStore
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import wait_until
from tests.metering.test_usage_e2e import UpProcess, free_port, send

pytestmark = pytest.mark.slow

FLEET = """nodes:
  - {name: node-a, cpu_milli: 8000, memory_mib: 65536, gpu_count: 1, gpu_model: cpu, gpu_memory_mib: 4096}
  - {name: node-b, cpu_milli: 8000, memory_mib: 65536, gpu_count: 1, gpu_model: cpu, gpu_memory_mib: 4096}
"""
PROFILE = (
    "name: e2e-defrag\ndescription: best fit, no failover reserve\nplugins:\n"
    "  - plugin: failover-headroom\n    args: {percent: 0}\n  - resource-fit\n  - plugin: bestfit\n    weight: 1\n"
)


def replica_processes(state: Path) -> set[int]:
    """PIDs of the live replica processes this cloud's launcher started (their repository is under ``state``)."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if status != "Z" and b"serve" in argv and any(a.startswith(str(state).encode()) for a in argv):
            found.add(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "(gone)"


@pytest.mark.parametrize("after_s", [0.0, 0.8, 1.6])
def test_kill_9_in_the_middle_of_a_move(tmp_path: Path, after_s: float) -> None:
    """``after_s``: the kill comes that long after the move's first event, so it finds the move in other phases."""
    repo = tmp_path / "models"
    write_linear_model(repo)
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "profile.yaml").write_text(PROFILE)
    extra = ("--fleet", str(tmp_path / "fleet.yaml"), "--policy", str(tmp_path / "profile.yaml"))
    state = tmp_path / "var"
    http, grpc = free_port(), free_port()
    first = UpProcess(repo, state, http, grpc, tmp_path / "up1.log", extra)
    second: UpProcess | None = None
    key = (state / "admin.key").read_text().strip()
    h = {"Authorization": f"Bearer {key}"}
    url = first.url

    def deployments() -> dict[str, list[dict[str, object]]]:
        data = httpx.get(f"{url}/admin/deployments", headers=h, timeout=10).json()["deployments"]
        return {d["spec"]["name"]: d["instances"] for d in data}

    def ready(name: str) -> int:
        return sum(1 for r in deployments().get(name, []) if r["state"] == "ready")

    try:
        # fragment: four half-card replicas fill both cards, then one leaves each card
        for name in ("p", "q", "r", "s"):
            spec = {"name": name, "model": "linear", "octants": 4}
            assert httpx.post(f"{url}/admin/deployments", json=spec, headers=h).status_code == 201
            wait_until(f"{name} ready", lambda n=name: ready(n) == 1, timeout=60)  # type: ignore[misc]
        by_node: dict[str, list[str]] = {}
        for name, instances in deployments().items():
            by_node.setdefault(str(instances[0]["node"]), []).append(name)
        assert sorted(len(v) for v in by_node.values()) == [2, 2], by_node
        stay = sorted(sorted(v)[1] for v in by_node.values())
        for v in by_node.values():
            assert httpx.delete(f"{url}/admin/deployments/{sorted(v)[0]}", headers=h).status_code == 200
        wait_until("the two left", lambda: set(deployments()) == set(stay), timeout=30)

        # a whole-card replica fits nowhere until a half-card one moves next to the other: kill -9 mid-move
        spec = {"name": "big", "model": "linear", "octants": 8}
        assert httpx.post(f"{url}/admin/deployments", json=spec, headers=h).status_code == 201

        def moving() -> bool:
            events = httpx.get(f"{url}/admin/events?limit=100", headers=h, timeout=10).json()["events"]
            return any(e["kind"] == "moving" for e in events)

        wait_until("a move to begin", moving, timeout=60, interval=0.02)
        time.sleep(after_s)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        store = StateStore.at(state / "octacloud.db")
        phases = [t.phase for t in store.transitions()]
        store.close()
        print("recorded at the kill:", phases, "replica processes:", len(replica_processes(state)))

        second = UpProcess(repo, state, http, grpc, tmp_path / "up2.log", extra)
        wait_until("big placed after the restart", lambda: ready("big") == 1, timeout=120)

        why: list[str] = []

        def settled() -> bool:
            now = deployments()
            serving = {n: [r for r in rs if r["state"] == "ready"] for n, rs in now.items()}
            store = StateStore.at(state / "octacloud.db")
            try:
                open_transitions = store.transitions()
            finally:
                store.close()
            pids = {int(str(rs[0]["pid"])) for rs in serving.values() if rs}
            found = replica_processes(state)
            why[:] = [
                f"replicas {[(n, r['id'], r['state'], r['pid']) for n, rs in now.items() for r in rs]}",
                f"transitions {open_transitions}",
                f"processes {sorted(found)} serving {sorted(pids)}",
                *(f"unknown {pid}: {cmdline(pid)}" for pid in found - pids),
            ]
            return (
                sorted(now) == sorted([*stay, "big"])
                and all(len(rs) == 1 for rs in now.values())
                and not open_transitions
                and found == pids
            )

        try:
            wait_until("one replica per deployment, no other process, no open transition", settled, timeout=60)
        except AssertionError:
            raise AssertionError("\n".join(why)) from None
        per_card: dict[tuple[str, int], int] = {}
        for rs in deployments().values():
            for r in rs:
                for card in r["gpus"]:  # type: ignore[attr-defined]
                    key_ = (str(r["node"]), int(card))
                    per_card[key_] = per_card.get(key_, 0) + int(str(r["milli_per_gpu"]))
        assert per_card == {("node-a", 0): 1000, ("node-b", 0): 1000}, per_card  # 1000 + 500 + 500, reserved once

        for name in stay:  # the new gateway routes to the deployments that stayed
            wait_until(
                f"{name} through the gateway",
                lambda n=name: httpx.get(  # type: ignore[misc]
                    f"{url}/v2/models/{n}/ready", headers=h, timeout=5
                ).status_code
                == 200,
                timeout=30,
            )
        for i in range(20):
            for name in (*stay, "big"):
                send(url, key, name, 1, i)  # asserts 200
        kinds = [e["kind"] for e in httpx.get(f"{url}/admin/events?limit=500", headers=h).json()["events"]]
        print("events after the restart:", [k for k in kinds if k.startswith("mov") or "roll" in k])
    finally:
        for up in (first, second):
            if up is not None and up.proc.poll() is None:
                up.proc.kill()
                up.proc.wait(10)
        for pid in replica_processes(state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
