"""Fixtures every area shares: the state store's database, on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from octacloud.database import sqlite_url

from .postgres import INSTALL_HINT, PostgresServer, binaries

STORES = ("sqlite", "postgresql")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session, on loopback (``make pgsql`` installs it; ``make test`` does)."""
    found = binaries()
    if found is None:
        pytest.fail(INSTALL_HINT)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("the PostgreSQL driver is missing: run `make postgres` (pip install 'octacloud[postgres]')")
    server = PostgresServer(found)
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty state-store database: a SQLite file, then a database on the PostgreSQL server."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "state.db")
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.database()
