"""The example builder is cached and deterministic (on the tiny MLP; the big models are built by `make models`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.examples import STATE_FILENAME, build_examples


def test_builds_once_then_skips_and_rebuilds_when_the_fingerprint_changes(tmp_path: Path) -> None:
    first = build_examples(tmp_path, ["mlp"], threads=1)
    assert [(o.name, o.skipped) for o in first] == [("mlp", False)]
    model = (tmp_path / "mlp" / "1" / "model.onnx").read_bytes()
    assert [(o.name, o.skipped) for o in build_examples(tmp_path, ["mlp"], threads=1)] == [("mlp", True)]
    state = tmp_path / STATE_FILENAME
    state.write_text(json.dumps({"mlp": "stale"}))
    again = build_examples(tmp_path, ["mlp"], threads=1)
    assert [(o.name, o.skipped) for o in again] == [("mlp", False)]
    for name in ("mlp", "mlp_fp16", "mlp_int8"):  # a rebuild is a new version; the old one is pruned
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["2", "config.pbtxt"]
    assert (tmp_path / "mlp" / "2" / "model.onnx").read_bytes() == model  # seeded: the same graph, byte for byte
    shutil.rmtree(tmp_path / "mlp_int8")  # recorded as built, but a variant is gone
    assert [o.skipped for o in build_examples(tmp_path, ["mlp"], threads=1)] == [False]
    assert (tmp_path / "mlp_int8" / "1" / "model.onnx").is_file()


def test_unknown_example_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match=r"unknown example model\(s\) \['gpt5'\]; choose from"):
        build_examples(tmp_path, ["gpt5"])


def test_a_variant_declared_outside_tolerance_is_recorded_removed_and_not_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from octacloud.toolchain import convert, examples
    from octacloud.toolchain.parity import DEFAULT_TOLERANCES

    build_examples(tmp_path, ["mlp"], threads=1)
    assert (tmp_path / "mlp_int8").is_dir()
    impossible = dict(DEFAULT_TOLERANCES) | {"int8": DEFAULT_TOLERANCES["fp32"]}
    monkeypatch.setattr(convert, "DEFAULT_TOLERANCES", impossible)  # int8 now misses its tolerance
    with pytest.raises(InvalidSpecError, match=r"\['mlp_int8'\] are outside tolerance"):  # not declared: an error
        build_examples(tmp_path, ["mlp"], threads=1, rebuild=True)
    mlp = next(e for e in examples.example_models() if e.name == "mlp")
    declared = dataclasses.replace(mlp, outside_tolerance={"int8": "a test says so"})
    monkeypatch.setattr(examples, "example_models", lambda: (declared,))
    said: list[str] = []
    [outcome] = build_examples(tmp_path, ["mlp"], threads=1, rebuild=True, progress=said.append)
    assert outcome.result is not None and [v.name for v in outcome.result.rejected] == ["mlp_int8"]
    assert not (tmp_path / "mlp_int8").exists()  # the earlier build's int8 is not left to be served
    recorded = examples.read_state(tmp_path)["mlp"].rejected
    assert list(recorded) == ["mlp_int8"] and "cosine similarity" in recorded["mlp_int8"]
    assert any("mlp_int8: outside tolerance, as expected" in m and "a test says so" in m for m in said)
    assert [o.skipped for o in build_examples(tmp_path, ["mlp"], threads=1)] == [True]  # built, as recorded
