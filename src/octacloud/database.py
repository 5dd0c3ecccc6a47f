"""The SQL database behind the state store and the key store: one way to open it.

SQLite by default (a file in the state folder, written by several processes: the cloud and its gateway
workers), PostgreSQL or any SQLAlchemy URL otherwise.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def open_engine(url: str) -> Engine:
    """An engine for ``url``; on SQLite in WAL mode with a busy timeout, so that processes share the file."""
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
