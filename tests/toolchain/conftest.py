"""Shared fixtures: a tiny MLP saved as a PyTorch file, fast conversion settings, repository snapshots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from octacloud.toolchain.convert import ConvertOptions
from octacloud.toolchain.profiling import ProfileSettings
from octacloud.toolchain.spec import TensorSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MLP_INPUT = TensorSpec("input", "float32", (None, 16))
FAST_PROFILE = ProfileSettings(threads=1, batch_sizes=(1, 4), budget_s=0.01, min_iterations=2, max_iterations=5)


def fast_options(name: str = "tiny", **kw: object) -> ConvertOptions:
    return ConvertOptions(name=name, max_batch_size=8, profile=FAST_PROFILE, **kw)  # type: ignore[arg-type]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content: equal snapshots mean an untouched repository."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def models_dir() -> Path:
    return Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))


@pytest.fixture(scope="session")
def mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16→32→4 MLP saved with ``torch.save`` (a whole module, not a state_dict)."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    path = tmp_path_factory.mktemp("src") / "mlp.pt"
    torch.save(module, path)
    return path


@pytest.fixture
def built_models() -> Path:
    path = models_dir()
    if not (path / "minilm" / "config.pbtxt").is_file():
        pytest.skip(f"the example model repository is not built at {path}: run `make models` (or set OCTACLOUD_MODELS)")
    return path
