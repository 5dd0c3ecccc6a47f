"""A real PostgreSQL server for tests: Debian's ``postgresql`` (``make pgsql`` installs it), started on loopback in
a fresh data folder and stopped by its PID.

PostgreSQL refuses to run as root, so under root (CI, the test sandbox) the server runs as the ``postgres`` user
the Debian package creates; otherwise as the user running the tests. Each test asks for a database of its own
(:meth:`PostgresServer.database`), so tests never see each other's rows.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

INSTALL_HINT = "PostgreSQL is not installed: run `make pgsql` (apt-get install postgresql)"
START_TIMEOUT_S = 60.0


def binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that holds ``postgres`` and ``initdb``."""
    root = Path("/usr/lib/postgresql")
    found = [p / "bin" for p in root.iterdir() if (p / "bin" / "postgres").exists()] if root.is_dir() else []
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One server for a test session: :meth:`start`, then :meth:`database` per test, :meth:`stop` at the end."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.folder = Path(tempfile.mkdtemp(prefix="octacloud-pg-"))
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._databases = 0
        self._user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

    def _as_user(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self._user, "--", *argv] if os.geteuid() == 0 else argv

    def start(self) -> None:
        data, sockets = self.folder / "data", self.folder / "run"
        sockets.mkdir()
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self._user)
            for path in (self.folder, sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            self._as_user([str(self.bin / "initdb"), "-D", str(data), "-U", "octacloud", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
            timeout=120,
        )
        with (self.folder / "postgres.log").open("wb") as log:
            self._spawn(data, sockets, log)
        self._wait()

    def _spawn(self, data: Path, sockets: Path, log: IO[bytes]) -> None:
        self.process = subprocess.Popen(
            self._as_user([
                str(self.bin / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(self.port),
                "-k", str(sockets), "-c", "fsync=off", "-c", "max_connections=200",
            ]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def _wait(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited at start: {(self.folder / 'postgres.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                if self._psql("SELECT 1").returncode == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not accept connections within {START_TIMEOUT_S:g} s")

    def _psql(self, sql: str, database: str = "postgres") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "octacloud", "-d", database,
             "-v", "ON_ERROR_STOP=1", "-qAtc", sql],
            capture_output=True, timeout=60,
        )  # fmt: skip

    def database(self) -> str:
        """A new, empty database; its SQLAlchemy URL."""
        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}"
        done = self._psql(f"CREATE DATABASE {name}")
        if done.returncode != 0:
            raise RuntimeError(f"CREATE DATABASE {name} failed: {done.stderr.decode()}")
        return f"postgresql+psycopg://octacloud@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # "fast" shutdown: ends sessions, then exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
