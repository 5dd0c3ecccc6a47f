"""Optional parts say which extra to install when it is missing."""

from __future__ import annotations

import pytest

from octacloud.core import extras
from octacloud.core.extras import MissingExtraError, require


def test_missing_extra_names_the_extra_and_the_make_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRAS, "build", (("json", "octacloud_no_such_module"), "building models"))
    with pytest.raises(MissingExtraError) as exc:
        require("build")
    message = str(exc.value)
    assert "octacloud_no_such_module" in message
    assert "json" not in message.split("needs")[1].split("which")[0]  # only the missing module is named
    assert "pip install 'octacloud[build]'" in message
    assert "make build-tools" in message


def test_present_extra_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRAS, "plots", (("json",), "the simulator's figures"))
    require("plots")


def test_every_extra_is_declared_in_pyproject() -> None:
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert set(extras.EXTRAS) <= set(pyproject["project"]["optional-dependencies"])
