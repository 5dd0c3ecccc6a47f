"""What several benches need from the machine: a free loopback port, a process's CPU time, the local replica
process behind a port. Imported by the bench scripts, which run with this folder first on ``sys.path``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


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


def find_replica_pid(http_port: int) -> int:
    """The local replica process serving ``http_port`` (its command line names the port)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(http_port).encode() in argv:
            return int(entry)
    raise SystemExit(f"no local replica process serving port {http_port}")
