"""`octacloud down` stops the replicas a stopped `octacloud up` left running, and only those, and refuses while
`up` runs (the state dir's lock, which a killed `up` does not leave behind); `up` refuses bad intervals and a
state dir another `up` holds before it starts anything. (With the Ray backend: tests/ray/test_down_ray.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from octacloud.cli.down import STOPPED_BY_DOWN
from octacloud.cli.main import app
from octacloud.cli.up import hold_up_lock, up_record
from octacloud.control.deployments import Deployment, DeploymentSpec, Replica, ReplicaState
from octacloud.control.store import StateStore

from .controller_fakes import Harness


def test_down_stops_recorded_replicas(tmp_path: Path) -> None:
    replica = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        store = StateStore.at(tmp_path / "octacloud.db")
        store.put_replica(Replica("m-1", "m", "n0", (0,), 125, ReplicaState.READY, handle=str(replica.pid)))
        store.close()
        result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path), "--grace", "2"])
        assert result.exit_code == 0, result.output
        assert "stopped 1 replica(s)" in result.output
        deadline = time.monotonic() + 5
        while replica.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replica.poll() is not None
        assert bystander.poll() is None
    finally:
        for p in (replica, bystander):
            p.kill()
            p.wait()


def test_down_without_state_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path / "nothing")])
    assert result.exit_code == 2
    assert "no octacloud state" in result.output


def test_up_refuses_non_positive_intervals_before_starting_anything(tmp_path: Path) -> None:
    for flag in ("--interval", "--meter-interval", "--telemetry-interval"):
        result = CliRunner().invoke(
            app, ["up", "--repository", str(tmp_path), "--state-dir", str(tmp_path / "var"), flag, "0"]
        )
        assert result.exit_code == 2, result.output
        assert f"{flag} must be a positive number of seconds, got 0" in result.output
        assert not (tmp_path / "var").exists()  # nothing was started or written


def test_down_refuses_while_up_holds_the_state_dir(tmp_path: Path) -> None:
    replica = subprocess.Popen(["sleep", "60"])
    try:
        store = StateStore.at(tmp_path / "octacloud.db")
        store.put_replica(Replica("m-1", "m", "n0", (0,), 125, ReplicaState.READY, handle=str(replica.pid)))
        store.close()
        with hold_up_lock(tmp_path, {"backend": "local"}):
            result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
            assert result.exit_code == 1, result.output
            assert f"octacloud up (PID {os.getpid()}) is running on {tmp_path}" in result.output
            assert replica.poll() is None  # nothing was stopped
        result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path), "--grace", "2"])
        assert result.exit_code == 0 and "stopped 1 replica(s)" in result.output, result.output
    finally:
        replica.kill()
        replica.wait()


def test_up_refuses_a_state_dir_another_up_holds(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with hold_up_lock(tmp_path / "var", {"backend": "local"}):
        result = CliRunner().invoke(app, ["up", "--repository", str(tmp_path / "models"), "--state-dir",
                                          str(tmp_path / "var")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "is running on the state dir" in result.output and "one cloud per state dir" in result.output
    assert not (tmp_path / "var" / "octacloud.db").exists()  # nothing was started


def test_an_up_killed_with_sigkill_leaves_no_lock_behind(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from octacloud.cli.up import hold_up_lock\n"
         "with hold_up_lock(Path(sys.argv[1]), {'backend': 'local'}):\n    print('held', flush=True); time.sleep(60)",
         str(tmp_path)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        running, record = up_record(tmp_path)
        assert running and record["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    running, record = up_record(tmp_path)
    assert not running and record["pid"] == holder.pid and record["backend"] == "local"  # the record stays
    StateStore.at(tmp_path / "octacloud.db").close()
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0 and "stopped 0 replica(s)" in result.output, result.output


async def test_a_replica_down_stopped_starts_again_on_its_slice_without_counting_a_restart(tmp_path: Path) -> None:
    """`down` then `up` is a planned restart: the next controller re-accounts the replica's slice and starts it
    there, with no "restart #1" (before, every replica came back as a failure restart)."""
    replica = subprocess.Popen(["sleep", "60"])
    try:
        store = StateStore.at(tmp_path / "octacloud.db")
        store.put_deployment(Deployment(DeploymentSpec("m", "m", octants=1), 1, 1, created_at=1.0))
        store.put_replica(Replica("m-1", "m", "n0", (0,), 125, ReplicaState.READY, handle=str(replica.pid),
                                  model="m", octants=1))  # fmt: skip
        store.close()
        result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path), "--grace", "2"])
        assert result.exit_code == 0 and "stopped 1 replica(s)" in result.output, result.output
        replica.wait(timeout=30)
    finally:
        replica.kill()
        replica.wait()
    store = StateStore.at(tmp_path / "octacloud.db")
    [r] = store.replicas()
    assert (r.state, r.handle, r.node, r.gpus, r.message) == (ReplicaState.PENDING, "", "n0", (0,), STOPPED_BY_DOWN)

    h = Harness(tmp_path / "next-up", store=store)  # the next `up` over the same state
    h.controller.adopt()
    await h.health()
    await h.health()
    [r] = h.replicas("m")
    assert (r.id, r.state, r.node, r.gpus, r.restarts) == ("m-1", ReplicaState.READY, "n0", (0,), 0)
    assert h.events("restart") == []
