"""``LocalProcessLauncher.handles``: the replica processes of this cloud, found on the machine (a restarted
controller stops those its store does not know), and not another cloud's on the same machine."""

from __future__ import annotations

import time
from pathlib import Path

from octacloud.cluster.launcher import LaunchSpec, LocalProcessLauncher

from .conftest import write_linear_model


def test_handles_are_this_clouds_live_replica_processes(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_linear_model(repo)
    ours = LocalProcessLauncher(tmp_path / "cloud-a" / "replicas")
    theirs = LocalProcessLauncher(tmp_path / "cloud-b" / "replicas")
    launched = ours.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    other = theirs.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    try:
        # (a process's command line reads empty for a moment after posix_spawn returns, as its environment does)
        deadline = time.monotonic() + 10
        while len(ours.handles() + theirs.handles()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert LocalProcessLauncher(tmp_path / "cloud-a" / "replicas").handles() == [launched.handle]  # a new one
        assert theirs.handles() == [other.handle]
    finally:
        ours.stop(launched.handle, 2.0)
        theirs.stop(other.handle, 2.0)
    assert ours.handles() == [] and theirs.handles() == []
