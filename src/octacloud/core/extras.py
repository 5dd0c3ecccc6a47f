"""Optional parts of octacloud and the extra that installs each (pyproject's optional dependencies).

The runtime (serving, the cloud, the CLI) needs none of them; a command that does says which extra to
install instead of failing on an import deep inside.
"""

from __future__ import annotations

import importlib.util

from octacloud.core.errors import OctacloudError

EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "ray": (("ray",), "the Ray backend (up --backend ray)"),
    "plots": (("matplotlib",), "the simulator's figures"),
    "build": (("onnx", "torch", "transformers"), "building models (convert, models build)"),
}


class MissingExtraError(OctacloudError, ImportError):
    """An optional part is used but its extra is not installed. The message names the extra to install."""


def require(extra: str) -> None:
    """Raise :class:`MissingExtraError` unless the packages behind ``extra`` are importable."""
    modules, purpose = EXTRAS[extra]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"{purpose} needs {', '.join(missing)}, which is not installed: pip install 'octacloud[{extra}]' "
            f"(in a checkout: make {'build-tools' if extra == 'build' else extra})"
        )
