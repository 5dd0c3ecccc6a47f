"""``LocalProcessLauncher.handles``: the replica processes of this cloud, found on the machine (a restarted
controller stops those its store does not know), and not another cloud's on the same machine."""

from __future__ import annotations

import time
from pathlib import Path

from octacloud.control.launcher import LaunchSpec, LocalProcessLauncher

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


def test_a_replica_inherits_its_ports_bound_and_no_other_process_can_take_them(tmp_path: Path) -> None:
    """The launcher binds the replica's three ports and hands the sockets over (descriptors 3, 4, 5): from the
    launch until the replica exits nothing else can bind them, connections are refused until the replica
    listens, and the launcher keeps no copy."""
    import errno
    import json
    import socket
    import sys

    import pytest

    dump, release = tmp_path / "fds.json", tmp_path / "release"
    fake_python = tmp_path / "python"  # stands in for `python -m octacloud serve`: records what it inherited
    fake_python.write_text(
        f"#!{sys.executable}\n"
        "import json, os, socket, sys, time\n"
        "argv = sys.argv\n"
        "fds = [int(argv[argv.index(f'--{k}-fd') + 1]) for k in ('http', 'grpc', 'metrics')]\n"
        "ports = [socket.socket(fileno=os.dup(fd)).getsockname()[1] for fd in fds]\n"
        f"open({str(dump)!r} + '.tmp', 'w').write(json.dumps({{'fds': fds, 'ports': ports}}))\n"
        f"os.rename({str(dump)!r} + '.tmp', {str(dump)!r})\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.02)\n"
    )
    fake_python.chmod(0o755)
    launcher = LocalProcessLauncher(tmp_path / "replicas", python=str(fake_python))
    repo = tmp_path / "models"
    write_linear_model(repo)
    launched = launcher.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    try:
        assert launched.address is not None
        ports = [launched.address.http_port, launched.address.grpc_port, launched.address.metrics_port]
        assert len(set(ports)) == 3
        for port in ports:  # held from the launch on, even before the replica has run a line
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="in use") as e:
                    other.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
        deadline = time.monotonic() + 10
        while not dump.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = json.loads(dump.read_text())
        assert seen == {"fds": [3, 4, 5], "ports": ports}
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", ports[0]))  # bound, not listening: refused until the replica serves
    finally:
        release.touch()
    deadline = time.monotonic() + 10
    while launcher.alive(launched.handle) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not launcher.alive(launched.handle)
    for port in ports:  # the replica is gone and the launcher kept no copy: the ports are free again
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))
