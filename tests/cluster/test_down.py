"""`octacloud down` stops the replicas a stopped `octacloud up` left running, and only those; `up` refuses bad
intervals before it starts anything."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.cluster.deployments import Replica, ReplicaState
from octacloud.cluster.store import StateStore


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
