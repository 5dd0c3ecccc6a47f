"""The state folder is its owner's alone: the database (with its write-ahead log), keys and secrets are 0600 and
the folders 0700, whatever the umask, and a state folder left by an older octacloud is tightened on start."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from octacloud.app import Cloud, CloudConfig
from octacloud.control.deployments import Deployment, DeploymentSpec
from octacloud.core.clock import ManualClock
from octacloud.core.model import Gpu, Node
from octacloud.database import open_engine, private_folder, sqlite_url


@pytest.fixture(autouse=True)
def lax_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what most shells have: files 0644, folders 0755 unless the code says otherwise
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def cloud_at(tmp_path: Path) -> Cloud:
    (tmp_path / "models" / "m" / "1").mkdir(parents=True, exist_ok=True)
    node = Node("n0", 16_000, 65_536, (Gpu(0, "T4", 16_384),))
    config = CloudConfig(repository=tmp_path / "models", state_dir=tmp_path / "state")
    return Cloud(config, nodes=[node], clock=ManualClock())


def open_to_others(state: Path) -> list[str]:
    """Every file or folder under ``state`` that its group or others may read, write or enter."""
    found = [state, *state.rglob("*")]
    return sorted(f"{p.relative_to(state.parent)} {mode(p):o}" for p in found if mode(p) & 0o077)


def test_a_new_state_folder_is_private(tmp_path: Path) -> None:
    cloud = cloud_at(tmp_path)
    cloud.store.put_deployment(Deployment(DeploymentSpec("a", "m", tenant="admin"), 1, 1))  # the WAL has pages
    state = tmp_path / "state"
    assert (state / "octacloud.db-wal").exists() and (state / "replicas").is_dir()
    assert open_to_others(state) == []
    assert mode(state) == 0o700 and mode(state / "replicas") == 0o700
    assert mode(state / "octacloud.db") == mode(state / "octacloud.db-wal") == 0o600


def test_an_older_state_folder_is_tightened_on_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cloud_at(tmp_path).store.put_deployment(Deployment(DeploymentSpec("a", "m", tenant="admin"), 1, 1))
    older = [state, state / "replicas", *state.glob("octacloud.db*")]  # what an older octacloud left open
    for path in older:
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert len(open_to_others(state)) == len(older) >= 4
    cloud = cloud_at(tmp_path)
    assert open_to_others(state) == []
    assert [d.spec.name for d in cloud.store.deployments()] == ["a"]  # the same database, read as before


def test_private_folder_keeps_stricter_modes(tmp_path: Path) -> None:
    strict = tmp_path / "strict"
    strict.mkdir(mode=0o500)
    assert private_folder(strict) == strict and mode(strict) == 0o500
    assert mode(private_folder(tmp_path / "a" / "b")) == 0o700


def test_a_database_url_with_options_makes_the_file_it_names_private(tmp_path: Path) -> None:
    engine = open_engine(sqlite_url(tmp_path / "x.db") + "?timeout=5")
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
    engine.dispose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"] and mode(tmp_path / "x.db") == 0o600
    open_engine("sqlite:///:memory:").dispose()  # nothing to make private, nothing made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]
