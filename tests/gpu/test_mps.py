"""The MPS control daemon's life, against a fake ``nvidia-cuda-mps-control`` and the fake NVML."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from octacloud.control.mps import EXCLUSIVE_PROCESS, MpsDaemon, NvmlComputeModes, SharingMode
from tests.gpu.fake_mps import _alive, write_fake
from tests.observability.fakes import FakeCard, FakeNvml


def _commands(daemon: MpsDaemon) -> list[str]:
    log = daemon.pipe_dir / "commands.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def daemon(tmp_path: Path) -> MpsDaemon:
    fake = write_fake(tmp_path / "bin")
    d = MpsDaemon(tmp_path / "state", cards=(0, 1), binary=str(fake), start_timeout_s=5)
    yield d
    d.stop()


def test_start_runs_the_daemon_on_the_clouds_own_pipe_folder(daemon: MpsDaemon) -> None:
    assert daemon.start() is SharingMode.MPS
    first = next(line for line in _commands(daemon) if line.startswith("-d|"))
    assert f"pipe={daemon.pipe_dir}" in first  # never the machine-wide /tmp/nvidia-mps
    assert f"log={daemon.log_dir}" in first
    assert daemon.environment() == {
        "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(daemon.log_dir),
    }
    assert oct(daemon.pipe_dir.stat().st_mode & 0o777) == "0o700"


def test_stop_quits_the_daemon(daemon: MpsDaemon) -> None:
    daemon.start()
    pid = int((daemon.pipe_dir / "daemon.pid").read_text())
    daemon.stop()
    assert any(line.startswith("-|quit|") for line in _commands(daemon))
    assert daemon.servers() is None  # no daemon answers any more
    assert daemon.environment() == {}
    assert not _alive(pid)


def test_a_running_daemon_is_adopted_not_started_twice(daemon: MpsDaemon, tmp_path: Path) -> None:
    daemon.start()
    again = MpsDaemon(daemon.state_dir, binary=daemon.binary)
    assert again.start() is SharingMode.MPS
    assert sum(line.startswith("-d|") for line in _commands(daemon)) == 1


def test_a_killed_daemon_is_restarted_and_its_clients_restart(daemon: MpsDaemon) -> None:
    daemon.start()
    assert not daemon.check().clients_lost
    os.kill(int((daemon.pipe_dir / "daemon.pid").read_text()), signal.SIGKILL)
    check = daemon.check()
    assert check.daemon_restarted and check.clients_lost
    assert daemon.mode is SharingMode.MPS
    assert daemon.restarts == 1
    assert sum(line.startswith("-d|") for line in _commands(daemon)) == 2
    assert not daemon.check().clients_lost


def test_a_crashed_server_is_reported(daemon: MpsDaemon) -> None:
    daemon.start()
    (daemon.pipe_dir / "servers").write_text("4242\n4343\n")
    assert daemon.check().servers_lost == ()
    (daemon.pipe_dir / "servers").write_text("4343\n")
    check = daemon.check()
    assert check.servers_lost == (4242,)
    assert check.clients_lost


def test_without_the_binary_the_node_falls_back_to_time_slicing(tmp_path: Path) -> None:
    d = MpsDaemon(tmp_path / "state", binary="nvidia-cuda-mps-control-that-is-not-installed")
    assert d.start() is SharingMode.TIME_SLICING
    assert "not found" in d.reason
    assert d.environment() == {}  # replicas get no pipe folder to wait on
    assert d.check().clients_lost is False


def test_a_daemon_that_never_answers_falls_back(tmp_path: Path) -> None:
    silent = tmp_path / "nvidia-cuda-mps-control"
    # "-d" succeeds, then no command ever finds the daemon
    silent.write_text(
        '#!/bin/sh\n[ "$1" = "-d" ] && exit 0\necho "Cannot find MPS control daemon process" >&2\nexit 1\n'
    )
    silent.chmod(0o755)
    d = MpsDaemon(tmp_path / "state", binary=str(silent), start_timeout_s=0.3)
    assert d.start() is SharingMode.TIME_SLICING
    assert "did not answer" in d.reason


class _ModalNvml(FakeNvml):
    def __init__(self, cards: list[FakeCard], allowed: bool) -> None:
        super().__init__(cards)
        self.modes = [0] * len(cards)
        self.allowed = allowed

    def nvmlDeviceGetComputeMode(self, h: int) -> int:
        return self.modes[h]

    def nvmlDeviceSetComputeMode(self, h: int, mode: int) -> None:
        if not self.allowed:
            raise self.NVMLError("Insufficient Permissions")
        self.modes[h] = mode


@pytest.mark.parametrize("allowed", [True, False])
def test_cards_go_exclusive_where_allowed_and_come_back(tmp_path: Path, allowed: bool) -> None:
    nvml = _ModalNvml([FakeCard(), FakeCard()], allowed)
    d = MpsDaemon(
        tmp_path / "s", cards=(0, 1), binary=str(write_fake(tmp_path / "bin")), compute_modes=NvmlComputeModes(nvml)
    )
    assert d.start() is SharingMode.MPS  # not being allowed to change the mode is no reason to give up MPS
    assert nvml.modes == ([EXCLUSIVE_PROCESS] * 2 if allowed else [0, 0])
    d.stop()
    assert nvml.modes == [0, 0]


def test_every_local_replica_gets_its_nodes_mps_folders(tmp_path: Path, daemon: MpsDaemon) -> None:
    """The launcher asks the node's environment at each launch: after the daemon starts, replicas reach it; the
    slice's own variables (its thread percentage, its memory) still come on top."""
    import json
    import sys
    import time

    from octacloud.control.launcher import LaunchSpec, LocalProcessLauncher
    from tests.cluster.conftest import write_linear_model

    dump = tmp_path / "env.json"
    fake_python = tmp_path / "python"  # stands in for `python -m octacloud serve`: records what it was given
    fake_python.write_text(
        f"#!{sys.executable}\nimport json, os\nopen({str(dump)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    fake_python.chmod(0o755)
    launcher = LocalProcessLauncher(tmp_path / "replicas", python=str(fake_python), environment=daemon.environment)
    folder = write_linear_model(tmp_path / "repo")
    slice_env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    daemon.start()
    launcher.launch(LaunchSpec("linear-abcdef", "linear", folder, "1", slice_env, 1))
    deadline = time.monotonic() + 10
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    env = json.loads(dump.read_text())
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe_dir)
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.log_dir)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
