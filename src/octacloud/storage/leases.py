"""What a node cache must not touch: versions being fetched (a ``flock`` per version) and versions live
replicas use (a lease file per replica, naming its process).

A lease is live while its process runs: the file records the PID and the process's start time (so a PID
reused by another process does not keep a lease alive), and a replica killed with ``kill -9`` leaves a lease
that the next eviction finds dead and removes. Locks are ``flock``s, which the kernel releases when their
holder dies, so a download killed half-way holds nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


def entry_key(model: str, version: int) -> str:
    return f"{model}@{version}"


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created if needed); yields False when ``blocking`` is off and another
    holder has it (then nothing is held)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if not fields or fields[0] == "Z":
        return None
    return fields[19] if len(fields) > 19 else None


class Leases:
    """The leases of one node cache (``<root>/.leases/<name>.json``)."""

    def __init__(self, root: Path) -> None:
        self.folder = root / ".leases"

    def hold(self, name: str, entries: Iterable[str], pid: int | None = None) -> None:
        """Lease ``entries`` (``model@version``) to process ``pid`` (default: this one), replacing ``name``'s."""
        pid = os.getpid() if pid is None else pid
        start = process_start(pid)
        if start is None:
            raise ProcessLookupError(f"process {pid} is not running: it cannot hold a model-cache lease")
        self.folder.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"pid": pid, "start": start, "entries": sorted(set(entries))})
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(body)
        os.replace(tmp, self.folder / f"{name}.json")

    def release(self, name: str) -> None:
        (self.folder / f"{name}.json").unlink(missing_ok=True)

    def live(self) -> dict[str, set[str]]:
        """Entry → names of the live leases that hold it; dead leases are removed on the way."""
        held: dict[str, set[str]] = {}
        if not self.folder.is_dir():
            return held
        for path in self.folder.glob("*.json"):
            try:
                data = json.loads(path.read_text())
                pid, start, entries = int(data["pid"]), str(data["start"]), list(data["entries"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced right now, or not ours
            if process_start(pid) != start:
                path.unlink(missing_ok=True)  # its process is gone (or the PID is someone else's now)
                continue
            for entry in entries:
                held.setdefault(str(entry), set()).add(path.stem)
        return held
