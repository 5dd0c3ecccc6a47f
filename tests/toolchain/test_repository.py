"""Publishing into a Triton-layout repository: layout, generated config, versions, atomicity and rollback."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.profile import BatchMeasurement, ModelProfile, read_profile
from octacloud.toolchain.repository import (
    STAGING_DIRNAME,
    ModelRepository,
    StagedModel,
    build_config,
    variant_name,
)
from octacloud.toolchain.spec import TensorSpec

from .conftest import snapshot

INPUTS = [TensorSpec("input_ids", "int64", (None, None)), TensorSpec("attention_mask", "int64", (None, None))]
OUTPUTS = [TensorSpec("sentence_embedding", "float32", (None, 384))]
PROFILE = ModelProfile(
    model="placeholder",
    version=1,
    precision="fp32",
    weights_bytes=10,
    bytes_per_sample=3,
    max_batch_size=8,
    threads=1,
    runtime="onnxruntime x",
    measured_at="2026-01-01T00:00:00+00:00",
    batches=(BatchMeasurement(1, 1.0, 1.0, 1000.0, 1),),
)


def config(name: str, outputs: list[TensorSpec] = OUTPUTS) -> mc.ModelConfig:
    return build_config(name, INPUTS, outputs, max_batch_size=8, weights_bytes=10, bytes_per_sample=3, precision="fp32")


def stage(repo: ModelRepository, area: Path, name: str, payload: bytes = b"onnx", **kw: object) -> StagedModel:
    d = area / name
    d.mkdir()
    (d / "model.onnx").write_bytes(payload)
    return StagedModel(name, d, kw.get("config", config(name)), PROFILE)  # type: ignore[arg-type]


def test_the_config_is_triton_text_format_with_our_parameters() -> None:
    text = text_format.MessageToString(config("minilm"))
    parsed = text_format.Parse(text, mc.ModelConfig())
    assert parsed.platform == "onnxruntime_onnx" and parsed.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in parsed.input] == [("input_ids", [-1]), ("attention_mask", [-1])]
    assert parsed.input[0].data_type == mc.TYPE_INT64
    assert list(parsed.output[0].dims) == [384]
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 2000
    assert parsed.parameters["octacloud.weights_bytes"].string_value == "10"
    assert parsed.parameters["octacloud.bytes_per_sample"].string_value == "3"


def test_variants_are_separate_models() -> None:
    assert [variant_name("m", p) for p in ("fp32", "fp16", "int8")] == ["m", "m_fp16", "m_int8"]


def test_publish_adds_a_new_version_each_time(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path / "repo")
    for expected in (1, 2, 3):
        with repo.staging() as area:
            [published] = repo.publish([stage(repo, area, "m", payload=b"v%d" % expected)])
        assert published.version == expected
        assert (tmp_path / "repo" / "m" / str(expected) / "model.onnx").read_bytes() == b"v%d" % expected
        assert read_profile(published.path).version == expected
    assert repo.models() == ["m"] and repo.versions("m") == [1, 2, 3]
    assert repo.config("m").name == "m"
    assert not (tmp_path / "repo" / STAGING_DIRNAME).exists()


def test_a_version_gap_continues_after_the_highest(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    (tmp_path / "m" / "7").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(text_format.MessageToString(config("m")))
    with repo.staging() as area:
        [published] = repo.publish([stage(repo, area, "m")])
    assert published.version == 8


def test_a_different_signature_under_an_existing_name_is_refused(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    with repo.staging() as area:
        repo.publish([stage(repo, area, "m")])
    before = snapshot(tmp_path)
    other = config("m", [TensorSpec("sentence_embedding", "float32", (None, 768))])
    with repo.staging() as area, pytest.raises(InvalidSpecError, match="different inputs, outputs"):
        repo.publish([stage(repo, area, "m", config=other)])
    assert snapshot(tmp_path) == before


def test_a_failure_part_way_rolls_back_every_variant(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    with repo.staging() as area:
        repo.publish([stage(repo, area, "old")])
    before = snapshot(tmp_path)
    with repo.staging() as area:
        ok_new = stage(repo, area, "fresh")
        ok_old = stage(repo, area, "old")
        broken = dataclasses.replace(stage(repo, area, "broken"), directory=area / "vanished")
        with pytest.raises(FileNotFoundError):
            repo.publish([ok_new, ok_old, broken])
    assert snapshot(tmp_path) == before
    assert repo.models() == ["old"] and repo.versions("old") == [1]


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", " pad"])
def test_unusable_names_are_refused(tmp_path: Path, name: str) -> None:
    repo = ModelRepository(tmp_path)
    with repo.staging() as area, pytest.raises(InvalidSpecError, match="not usable as a repository directory"):
        repo.publish([StagedModel(name, area, config("x"), PROFILE)])


def test_staging_a_new_repository_leaves_nothing_when_nothing_is_published(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path / "new")
    with repo.staging() as area:
        assert area.is_dir()
    assert not (tmp_path / "new").exists()


def test_prune_keeps_the_newest_versions(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    for _ in range(3):
        with repo.staging() as area:
            repo.publish([stage(repo, area, "m")])
    assert repo.prune("m", keep=1) == [1, 2]
    assert repo.versions("m") == [3] and repo.prune("m", keep=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    with pytest.raises(InvalidSpecError, match="keep must be >= 1"):
        repo.prune("m", keep=0)


def test_a_model_directory_without_a_config_gets_one_and_loses_it_on_rollback(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    (tmp_path / "m" / "notes").mkdir(parents=True)
    before = snapshot(tmp_path)
    with repo.staging() as area:
        broken = dataclasses.replace(stage(repo, area, "zz"), directory=area / "vanished")
        with pytest.raises(FileNotFoundError):
            repo.publish([stage(repo, area, "m"), broken])
    assert snapshot(tmp_path) == before and not (tmp_path / "m" / "config.pbtxt").exists()
    with repo.staging() as area:
        [published] = repo.publish([stage(repo, area, "m")])
    assert published.version == 1 and repo.models() == ["m"]


def test_concurrent_publishers_take_turns_and_get_distinct_versions(tmp_path: Path) -> None:
    import threading

    repo = ModelRepository(tmp_path)
    errors: list[BaseException] = []
    versions: list[int] = []

    def publish() -> None:
        try:
            with repo.staging() as area:
                versions.extend(p.version for p in repo.publish([stage(repo, area, "m")]))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(versions) == [1, 2, 3, 4, 5, 6] and repo.versions("m") == [1, 2, 3, 4, 5, 6]


def test_a_staging_area_survives_another_publisher_removing_the_empty_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the concurrent-publishers test met now and then: between creating the shared staging folder and
    its own area inside it, another publisher's staging ended and removed the (then empty) folder."""
    import pathlib

    repo = ModelRepository(tmp_path)
    real_mkdir = pathlib.Path.mkdir
    removed: list[Path] = []

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.parent.name == STAGING_DIRNAME and not removed:
            self.parent.rmdir()  # as the other publisher's exit does, just before our area is made
            removed.append(self.parent)
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    with repo.staging() as area:
        assert area.is_dir() and removed
        [published] = repo.publish([stage(repo, area, "m")])
    assert published.version == 1 and repo.models() == ["m"]
