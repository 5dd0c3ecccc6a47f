"""`make install` chooses the GPU set where nvidia-smi lists a GPU, the CPU set elsewhere (make's dry run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path: Path, nvidia_smi: str | None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{nvidia_smi}'\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "install", f"VENV={tmp_path / 'venv'}"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_a_gpu_host_gets_onnxruntime_gpu_instead_of_the_cpu_build(tmp_path: Path) -> None:
    out = _dry_run(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)")
    assert "requirements/gpu.lock" in out
    assert "grep -v '^onnxruntime=='" in out  # the CPU build is left out of the runtime set
    assert "uninstall --quiet --yes onnxruntime" in out


@pytest.mark.parametrize("nvidia_smi", [None, "No devices were found"])
def test_a_host_without_gpus_gets_the_cpu_set(tmp_path: Path, nvidia_smi: str | None) -> None:
    out = _dry_run(tmp_path, nvidia_smi)
    assert "-r requirements/runtime.lock" in out
    assert "gpu.lock" not in out
