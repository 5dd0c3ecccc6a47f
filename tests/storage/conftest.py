"""Fixtures of the model-store tests: one SeaweedFS per module, a bucket per test, tiny models to publish."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from octacloud.storage.store import FsspecStore, open_store
from tests.storage.seaweed import SeaweedS3


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(seaweed: SeaweedS3) -> str:
    name = f"models-{uuid.uuid4().hex[:8]}"
    seaweed.create_bucket(name)
    return name


@pytest.fixture
def credentials(seaweed: SeaweedS3, tmp_path: Path) -> Path:
    return seaweed.credentials_file(tmp_path / "credentials")


@pytest.fixture
def s3_store(bucket: str, credentials: Path) -> FsspecStore:
    return open_store(f"s3://{bucket}/repo", credentials)


def write_version(repo: Path, name: str, version: int, weights: bytes, extra: dict[str, bytes] | None = None) -> Path:
    """A model folder in Triton's layout with one more version (its ``model.onnx`` is ``weights``)."""
    folder = repo / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(weights)
    for rel, data in (extra or {}).items():
        (folder / rel).write_bytes(data)
    (repo / name / "config.pbtxt").write_text(f'name: "{name}"\nmax_batch_size: 8\n')
    return folder


def random_bytes(n: int) -> bytes:
    return os.urandom(n)
