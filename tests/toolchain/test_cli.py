"""``octacloud convert`` and ``octacloud models list`` as a user runs them."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from octacloud.cli.main import app

from .conftest import snapshot

runner = CliRunner()


def test_convert_prints_the_parity_table_and_publishes(mlp_file: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    result = runner.invoke(
        app,
        [
            "convert",
            str(mlp_file),
            "--name",
            "cli_mlp",
            "--repo",
            str(repo),
            "--input",
            "input:float32:-1,16",
            "--output",
            "logits",
            "--classifier",
            "--max-batch-size",
            "4",
            "--batch-sizes",
            "1,2",
            "--profile-seconds",
            "0.01",
            "--threads",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    for name in ("cli_mlp", "cli_mlp_fp16", "cli_mlp_int8"):
        assert name in result.stdout
        assert (repo / name / "1" / "model.onnx").is_file()
    listed = runner.invoke(app, ["models", "list", "--repo", str(repo)])
    assert listed.exit_code == 0, listed.output
    assert "cli_mlp_int8" in listed.stdout and "int8" in listed.stdout


def test_convert_failures_exit_2_with_the_reason_and_publish_nothing(mlp_file: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "keep.txt").write_text("untouched")
    before = snapshot(repo)
    missing = runner.invoke(app, ["convert", str(tmp_path / "absent.onnx"), "--name", "x", "--repo", str(repo)])
    assert missing.exit_code == 2
    assert "absent.onnx does not exist" in missing.output and "nothing was published" in missing.output
    no_signature = runner.invoke(app, ["convert", str(mlp_file), "--name", "x", "--repo", str(repo)])
    assert no_signature.exit_code == 2 and "--input NAME:DTYPE:SHAPE" in no_signature.output
    bad_spec = runner.invoke(
        app, ["convert", str(mlp_file), "--name", "x", "--repo", str(repo), "--input", "input:float32:16"]
    )
    assert bad_spec.exit_code == 2 and "must be -1" in bad_spec.output
    assert snapshot(repo) == before


def test_convert_exits_1_naming_the_variants_outside_a_stricter_tolerance(mlp_file: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    result = runner.invoke(
        app,
        [
            "convert",
            str(mlp_file),
            "--name",
            "strict",
            "--repo",
            str(repo),
            "--input",
            "input:float32:-1,16",
            "--precision",
            "fp32",
            "--precision",
            "int8",
            "--tolerance",
            "int8:min_cosine=1.0,max_rel_error=1e-9",
            "--batch-sizes",
            "1",
            "--profile-seconds",
            "0.01",
            "--threads",
            "1",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "not published (outside parity tolerance): strict_int8" in result.output
    assert "rejected" in result.stdout
    assert sorted(p.name for p in repo.iterdir()) == ["strict"]
