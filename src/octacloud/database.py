"""The SQL database behind the state store and the key store: one way to open it.

SQLite by default (a file in the state folder, written by several processes: the cloud and its gateway
workers), PostgreSQL or any SQLAlchemy URL otherwise.

The state is its owner's alone: the folders that hold it are made (or tightened to) 0700 and an SQLite database
0600, with its write-ahead log and shared-memory files (SQLite gives them the database file's mode; those left
by an older octacloud are tightened when the database is opened).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine

log = logging.getLogger("octacloud")

SQLITE_PREFIX = "sqlite:///"
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")
"""The files SQLite keeps beside a database (write-ahead log, its index, the rollback journal)."""


def sqlite_url(path: Path) -> str:
    return f"{SQLITE_PREFIX}{path}"


def private_folder(path: Path) -> Path:
    """``path`` as a folder only its owner may enter: made with mode 0700 (parents too), or tightened to it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _tighten(path, 0o700)
    return path


def private_database(path: Path) -> None:
    """Make the SQLite database ``path`` (and whatever SQLite keeps beside it) readable by its owner only: created
    empty with mode 0600 when absent, so that SQLite creates its companions 0600 too."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for file in (path, *(path.with_name(path.name + suffix) for suffix in SQLITE_COMPANIONS)):
        _tighten(file, 0o600)


def _tighten(path: Path, mode: int) -> None:
    try:
        now = stat.S_IMODE(path.stat().st_mode)
        if now & 0o077:
            os.chmod(path, now & mode)
    except FileNotFoundError:
        pass
    except PermissionError as exc:  # someone else's file: say so, the cloud still starts
        log.warning("cannot make %s private (%s): chmod %o it", path, exc, mode)


def open_engine(url: str) -> Engine:
    """An engine for ``url``; on SQLite in WAL mode with a busy timeout, so that processes share the file (a
    database file made private first: :func:`private_database`)."""
    file = url[len(SQLITE_PREFIX) :].split("?", 1)[0] if url.startswith(SQLITE_PREFIX) else ""
    if file not in ("", ":memory:") and not file.startswith("file:"):
        private_database(Path(file))
    engine = create_engine(url, future=True)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
