"""``octacloud convert --publish URL``, ``models publish`` and ``models list --storage`` against a real S3 store
(SeaweedFS on loopback), as a user runs them; refused credentials exit 2 with the store's reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.storage.manifest import Manifest
from octacloud.storage.store import MANIFEST_FILE, open_store
from tests.storage.conftest import write_version
from tests.storage.seaweed import SeaweedS3
from tests.toolchain.conftest import mlp_file

pytestmark = pytest.mark.slow
runner = CliRunner()
__all__ = ["mlp_file"]  # the fixture, imported for this module's tests


def convert_args(source: Path, url: str, credentials: Path) -> list[str]:
    return ["convert", str(source), "--name", "cli_mlp", "--publish", url, "--storage-credentials", str(credentials),
            "--input", "input:float32:-1,16", "--output", "logits", "--precision", "fp32", "--max-batch-size", "4",
            "--batch-sizes", "1,2", "--profile-seconds", "0.01", "--threads", "1"]  # fmt: skip


def test_convert_publishes_into_the_store_and_models_list_reads_it(
    mlp_file: Path, bucket: str, credentials: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/repo"
    for expected in (1, 2):  # every publish adds the next version
        result = runner.invoke(app, convert_args(mlp_file, url, credentials))
        assert result.exit_code == 0, result.output
        assert open_store(url, credentials).versions("cli_mlp") == list(range(1, expected + 1))
    store = open_store(url, credentials)
    manifest = Manifest.from_json(store.read("cli_mlp", f"2/{MANIFEST_FILE}"), "test")
    assert {"model.onnx", "profile.json", "parity.json"} <= set(manifest.files)
    listed = runner.invoke(app, ["models", "list", "--storage", url, "--storage-credentials", str(credentials)])
    assert listed.exit_code == 0, listed.output
    assert "cli_mlp" in listed.stdout and "1,2" in listed.stdout and "fp32" in listed.stdout


def test_models_publish_pushes_a_local_repository(bucket: str, credentials: Path, tmp_path: Path) -> None:
    write_version(tmp_path / "local", "mlp", 1, b"w" * 1000)
    url = f"s3://{bucket}/repo"
    args = ["models", "publish", str(tmp_path / "local"), "--storage", url, "--storage-credentials", str(credentials)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert f"{url}/mlp/1: 1 file(s)" in first.stdout
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and f"{url}/mlp/1: already there" in again.stdout


def test_refused_credentials_exit_2_with_the_reason(
    mlp_file: Path, seaweed: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    wrong = seaweed.credentials_file(tmp_path / "wrong", secret="nope")
    url = f"s3://{bucket}/repo"
    listed = runner.invoke(app, ["models", "list", "--storage", url, "--storage-credentials", str(wrong)])
    assert listed.exit_code == 2 and "were refused" in listed.output
    converted = runner.invoke(app, convert_args(mlp_file, url, wrong))
    assert converted.exit_code == 2 and "were refused" in converted.output
    assert f"nothing was published to {url}" in converted.output
