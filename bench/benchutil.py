"""What several benches need from the machine: a free loopback port, a process's CPU time, the local replica
process behind a port, and ``octacloud up`` on a one-card CPU fleet (``LocalCloud``). Imported by the bench
scripts, which run with this folder first on ``sys.path``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
SRC = Path(__file__).resolve().parent.parent / "src"


def free_port() -> int:
    """A loopback port nothing listens on now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (field 3 onwards: state, ppid, ..., utime at 11, stime at 12)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads; not its children). Raises OSError when the
    process is gone."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) * TICK_S


def syscalls(pid: int) -> tuple[int, int]:
    """The read and write system calls one process has made so far (``/proc/PID/io``'s ``syscr`` and ``syscw``,
    all its threads). Raises OSError when the process is gone."""
    counts = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(counts["syscr"]), int(counts["syscw"])


def find_replica_pid(http_port: int) -> int:
    """The local process listening on ``http_port`` (the socket's inode in ``/proc/net/tcp*``, then the process
    holding it: a replica's command line no longer names its ports, the launcher hands it bound sockets)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == http_port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    return int(entry)
            except OSError:
                continue
    raise SystemExit(f"no local replica process serving port {http_port}")


def admin_call(url: str, key: str, method: str, path: str, body: object = None) -> Any:
    """One admin API call (``/admin{path}``) with ``key``; the JSON answer. Raises OSError (urllib's errors)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    req = urllib.request.Request(f"{url}/admin{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.loads(response.read())


class LocalCloud:
    """``octacloud up`` on a temporary state folder and a one-node, one-card CPU fleet, for a bench.

    ``start()`` waits for the admin key and API; ``deploy(spec)`` deploys and returns the first READY replica;
    ``stop()`` undeploys what was deployed, stops ``up`` (SIGTERM, then kill) and removes the folder. The gateway
    runs in ``up``'s own process (``--gateway-workers 0``), so that ``pid`` is the gateway's."""

    def __init__(
        self, repository: Path, *, prefix: str, cpu_milli: int | None = None, extra: Sequence[str] = ()
    ) -> None:
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.state = self.work / "var"
        fleet = self.work / "fleet.yaml"
        cpu = cpu_milli if cpu_milli is not None else (os.cpu_count() or 1) * 1000
        fleet.write_text(
            f"nodes:\n  - name: bench\n    cpu_milli: {cpu}\n    memory_mib: 16384\n"
            "    gpu_count: 1\n    gpu_model: cpu\n    gpu_memory_mib: 8192\n"
        )
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = self.work / "up.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONPATH": str(SRC)}  # this checkout's octacloud, as the bench itself imports
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "octacloud", "up", "--repository", str(repository.resolve()), "--fleet",
             str(fleet), "--state-dir", str(self.state), "--http-port", str(self.http_port), "--grpc-port",
             str(self.grpc_port), "--interval", "1", "--gateway-workers", "0", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self.key = ""
        self.secret = ""
        self._deployed: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def admin(self, method: str, path: str, body: object = None) -> Any:
        return admin_call(self.url, self.key, method, path, body)

    def start(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.key = (self.state / "admin.key").read_text().strip()
                self.admin("GET", "/deployments")
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"octacloud up did not start; see {self.log_path}") from None
                time.sleep(0.3)
        self.secret = (self.state / "internal.secret").read_text().strip()

    def deploy(self, spec: dict[str, object], timeout: float = 120.0) -> dict[str, Any]:
        """Deploy ``spec`` and wait for its first READY replica (the admin API's instance record)."""
        name = str(spec["name"])
        self.admin("POST", "/deployments", spec)
        self._deployed.append(name)
        deadline = time.monotonic() + timeout
        while True:
            ready = [r for r in self.admin("GET", f"/deployments/{name}")["instances"] if r["state"] == "ready"]
            if ready:
                return dict(ready[0])
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"deployment {name!r} did not become ready; see {self.work}")
            time.sleep(0.3)

    def stop(self) -> None:
        for name in self._deployed:  # stops the replica; its slice returns to the pool
            try:
                self.admin("DELETE", f"/deployments/{name}")
            except OSError as exc:
                print(f"warning: could not undeploy {name}: {exc}", file=sys.stderr)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.work, ignore_errors=True)
