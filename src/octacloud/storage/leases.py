"""What a node cache must not touch: versions being fetched (a ``flock`` per version) and versions live
replicas use (a lease per replica).

A lease is a lock file the replica's process holds a shared ``flock`` on for as long as it runs, and beside it
the versions it holds (``<name>.json``, replaced whole). Whether a lease is live is asked of the kernel — an
eviction tries to lock the file exclusively — so it works across processes, containers and PID namespaces
that share the cache folder (pods on one Kubernetes node), and a replica killed with ``kill -9`` loses its
lease with its process: the kernel drops its lock, and the next eviction removes what it left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


def entry_key(model: str, version: int) -> str:
    return f"{model}@{version}"


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True, shared: bool = False) -> Iterator[bool]:
    """A ``flock`` on ``path`` (created if needed), exclusive unless ``shared``; yields False when ``blocking``
    is off and another holder has it (then nothing is held)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        if not _lock(fd, blocking=blocking, shared=shared):
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lock(fd: int, *, blocking: bool, shared: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


_HELD: dict[Path, int] = {}
"""Lease lock files this process holds, with their descriptors (kept open: the lock lives as long as they do)."""
_HELD_LOCK = threading.Lock()


def _hold_lock(lock: Path) -> int:
    """A descriptor holding a shared lock on ``lock`` as it is now on disk (an eviction that found a dead
    lease may have removed the file between our open and our lock: then lock the new one)."""
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        _lock(fd, blocking=True, shared=True)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class Leases:
    """The leases of one node cache (``<root>/.leases/<name>.lock`` and ``<name>.json``)."""

    def __init__(self, root: Path) -> None:
        self.folder = root / ".leases"

    def hold(self, name: str, entries: Iterable[str]) -> None:
        """This process leases ``entries`` (``model@version``) under ``name`` until :meth:`release` or its exit
        (replacing what ``name`` held)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / f"{name}.lock"
        with _HELD_LOCK:
            if lock not in _HELD:
                _HELD[lock] = _hold_lock(lock)
        tmp = self.folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps({"entries": sorted(set(entries))}))
        os.replace(tmp, self.folder / f"{name}.json")

    def release(self, name: str) -> None:
        lock = self.folder / f"{name}.lock"
        (self.folder / f"{name}.json").unlink(missing_ok=True)
        with _HELD_LOCK:
            fd = _HELD.pop(lock, None)
        if fd is not None:
            os.close(fd)  # drops the lock
        with locked(lock, blocking=False) as free:
            if free:
                lock.unlink(missing_ok=True)

    def live(self) -> dict[str, set[str]]:
        """Entry → names of the live leases that hold it; what dead leases left is removed on the way."""
        held: dict[str, set[str]] = {}
        if not self.folder.is_dir():
            return held
        for lock in self.folder.glob("*.lock"):
            record = lock.with_suffix(".json")
            with locked(lock, blocking=False) as free:
                if free:  # nobody holds it: its process is gone
                    record.unlink(missing_ok=True)
                    lock.unlink(missing_ok=True)
                    continue
            try:
                entries = json.loads(record.read_text())["entries"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written right now: what it fetches is under its version's lock meanwhile
            for entry in entries:
                held.setdefault(str(entry), set()).add(lock.stem)
        return held
