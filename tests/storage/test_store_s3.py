"""The model store on a real S3 endpoint (SeaweedFS on loopback): publish, list, sizes, and clear errors for
refused credentials, a missing bucket and a store that went away."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.storage.manifest import Manifest
from octacloud.storage.publish import publish_folder, publish_version
from octacloud.storage.store import MANIFEST_FILE, FsspecStore, StoreUnavailableError, open_store
from tests.storage.conftest import random_bytes, write_version
from tests.storage.seaweed import SeaweedS3

pytestmark = pytest.mark.slow


def test_publish_lists_versions_and_sizes_with_a_manifest(s3_store: FsspecStore, tmp_path: Path) -> None:
    local = tmp_path / "local"
    write_version(local, "mlp", 1, random_bytes(3000), {"profile.json": b"{}"})
    write_version(local, "mlp", 2, random_bytes(5000))
    write_version(local, "bert", 1, random_bytes(100))
    published = publish_folder(s3_store, local)
    assert [(p.model, p.version, p.skipped) for p in published] == [("bert", 1, False), ("mlp", 1, False),
                                                                    ("mlp", 2, False)]  # fmt: skip
    assert s3_store.models() == ["bert", "mlp"]
    assert s3_store.versions("mlp") == [1, 2]
    manifest = Manifest.from_json(s3_store.read("mlp", f"1/{MANIFEST_FILE}"), "test")
    assert sorted(manifest.files) == ["model.onnx", "profile.json"] and manifest.total_bytes == 3002
    config = len((local / "mlp" / "config.pbtxt").read_bytes())
    assert s3_store.size("mlp") == 3002 + 5000 + config + len(s3_store.read("mlp", f"1/{MANIFEST_FILE}")) + len(
        s3_store.read("mlp", f"2/{MANIFEST_FILE}")
    )
    assert [p.skipped for p in publish_folder(s3_store, local, ["mlp"])] == [True, True]  # same content: skipped


def test_a_version_without_its_manifest_is_not_published_yet(s3_store: FsspecStore, tmp_path: Path) -> None:
    write_version(tmp_path, "mlp", 1, b"x" * 10)
    publish_folder(s3_store, tmp_path)
    s3_store.put("mlp", "2/model.onnx", b"half an upload")  # a publisher that died before the manifest
    assert s3_store.versions("mlp") == [1]


def test_a_published_version_is_immutable(s3_store: FsspecStore, tmp_path: Path) -> None:
    folder = write_version(tmp_path, "mlp", 1, b"a" * 10)
    publish_version(s3_store, "mlp", 1, folder, b'name: "mlp"\n')
    (folder / "model.onnx").write_bytes(b"b" * 10)
    with pytest.raises(InvalidSpecError, match="already has a version 1 with other content"):
        publish_version(s3_store, "mlp", 1, folder, b'name: "mlp"\n')


def test_missing_models_and_files_are_not_found(s3_store: FsspecStore, tmp_path: Path) -> None:
    write_version(tmp_path, "mlp", 1, b"x")
    publish_folder(s3_store, tmp_path)
    with pytest.raises(NotFoundError, match=r"model 'nope' is not in the model storage s3://"):
        s3_store.versions("nope")
    with pytest.raises(NotFoundError, match="'9/model.onnx' of model 'mlp'"):
        s3_store.read("mlp", "9/model.onnx")


def test_refused_credentials_name_the_store_and_the_reason(seaweed: SeaweedS3, bucket: str, tmp_path: Path) -> None:
    wrong = seaweed.credentials_file(tmp_path / "wrong", secret="not-the-secret")
    store = open_store(f"s3://{bucket}/repo", wrong)
    with pytest.raises(StoreUnavailableError) as caught:
        store.models()
    message = str(caught.value)
    assert f"model storage s3://{bucket}/repo at {seaweed.endpoint}" in message
    assert f"credentials from {wrong} were refused" in message and "SignatureDoesNotMatch" not in message[:30]
    with pytest.raises(StoreUnavailableError, match="were refused"):
        store.check()


def test_a_missing_bucket_is_named(seaweed: SeaweedS3, credentials: Path) -> None:
    store = open_store("s3://no-such-bucket/repo", credentials)
    with pytest.raises(StoreUnavailableError, match="the bucket 'no-such-bucket' does not exist: create it"):
        store.check()
    with pytest.raises(StoreUnavailableError, match="the bucket 'no-such-bucket' does not exist"):
        store.versions("mlp")


def test_credentials_file_errors_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "creds"
    bad.write_text("[default]\naws_access_key_id = x\n")
    with pytest.raises(InvalidSpecError, match=r"section \[default\] lacks aws_secret_access_key"):
        open_store("s3://b/p", bad)
    with pytest.raises(InvalidSpecError, match="cannot read it"):
        open_store("s3://b/p", tmp_path / "absent")
    with pytest.raises(InvalidSpecError, match="is for s3:// stores"):
        open_store(tmp_path, bad)


def test_a_store_that_went_away_is_named_with_the_reason(tmp_path: Path) -> None:
    server = SeaweedS3(tmp_path / "gone")
    server.start()
    server.create_bucket("models")
    store = open_store("s3://models/repo", server.credentials_file(tmp_path / "creds"))
    write_version(tmp_path / "local", "mlp", 1, b"x" * 10)
    publish_folder(store, tmp_path / "local")
    server.kill()
    with pytest.raises(StoreUnavailableError, match=rf"model storage s3://models/repo at {server.endpoint}: cannot "):
        store.versions("mlp")
    server.start()  # same folder, same ports: what was published is there again
    try:
        assert store.versions("mlp") == [1]
    finally:
        server.stop()
