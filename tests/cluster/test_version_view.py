"""A deployment pinned to a version serves exactly that version: the replica's one-model view links only that
version's folder and pins Triton's ``version_policy`` to it, so a newer version converted into the repository
later (or a replica restart after it) never switches what the deployment serves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.control.launcher import LaunchSpec, check_version, model_view
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.serving.repository.repository import ControlMode, ModelRepository

from .conftest import write_linear_model


def _two_versions(tmp_path: Path) -> Path:
    folder = write_linear_model(tmp_path / "models")
    shutil.copytree(folder / "1", folder / "2")
    return folder


def _spec(folder: Path, version: str, serve_as: str = "served") -> LaunchSpec:
    return LaunchSpec("r-1", serve_as, folder, version, {}, 1)


def _config(view: Path, name: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    text_format.Parse((view / name / "config.pbtxt").read_text(), config)
    return config


def test_pinned_view_links_only_that_version_and_pins_the_policy(tmp_path: Path) -> None:
    folder = _two_versions(tmp_path)
    view = model_view(_spec(folder, "1"), tmp_path / "replica")
    assert sorted(p.name for p in (view / "served").iterdir()) == ["1", "config.pbtxt"]
    config = _config(view, "served")
    assert config.name == "served"
    assert list(config.version_policy.specific.versions) == [1]
    assert config.max_batch_size == 8  # the rest of the model's config is kept


def test_unpinned_view_keeps_every_version_and_the_model_policy(tmp_path: Path) -> None:
    folder = _two_versions(tmp_path)
    view = model_view(_spec(folder, ""), tmp_path / "replica")
    assert sorted(p.name for p in (view / "served").iterdir()) == ["1", "2", "config.pbtxt"]
    assert _config(view, "served").version_policy.WhichOneof("policy_choice") is None


def test_a_view_rebuilt_after_a_new_version_still_serves_the_pinned_one(tmp_path: Path) -> None:
    folder = write_linear_model(tmp_path / "models")
    model_view(_spec(folder, "1"), tmp_path / "replica")
    shutil.copytree(folder / "1", folder / "3")  # a later convert publishes version 3; the replica restarts
    view = model_view(_spec(folder, "1"), tmp_path / "replica")
    assert sorted(p.name for p in (view / "served").iterdir()) == ["1", "config.pbtxt"]


async def test_the_replica_repository_serves_exactly_the_pinned_version(tmp_path: Path) -> None:
    folder = _two_versions(tmp_path)
    for version, served in (("1", ["1"]), ("2", ["2"]), ("", ["2"])):
        view = model_view(_spec(folder, version), tmp_path / f"replica-{version or 'latest'}")
        repo = ModelRepository(view, control_mode=ControlMode.EXPLICIT, threads=1)
        await repo.start(["served"])
        try:
            assert [m.version for m in repo.versions("served")] == served
            assert repo.get("served").version == served[-1]
        finally:
            await repo.close()


def test_a_missing_or_malformed_version_is_refused_with_the_versions_there(tmp_path: Path) -> None:
    folder = _two_versions(tmp_path)
    with pytest.raises(NotFoundError, match=r"has no version 7 \(its versions: 1, 2\)"):
        check_version(folder, "7")
    with pytest.raises(InvalidSpecError, match="whole number"):
        check_version(folder, "v1")
    with pytest.raises(NotFoundError, match="no version 7"):
        model_view(_spec(folder, "7"), tmp_path / "replica")
    check_version(folder, "")
    check_version(folder, "2")
