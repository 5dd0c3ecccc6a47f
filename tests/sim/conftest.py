"""Shared fixtures of the simulator tests: small hand-made fleets and traces, and the openb folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..traces import require_traces

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def openb() -> Path:
    return require_traces()


NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,2,T4
n1,32000,131072,4,V100M16
n2,16000,65536,1,T4
"""

PODS_CSV = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec
p0,4000,8192,1,500,
p1,4000,8192,1,1000,
p2,8000,8192,2,1000,V100M16
p3,2000,4096,0,0,
p4,4000,8192,1,250,
p5,4000,8192,1,460,T4
p6,4000,8192,1,1000,
p7,4000,8192,1,750,
"""


@pytest.fixture
def small_trace(tmp_path: Path) -> tuple[Path, Path]:
    """A 3-node, 7-GPU fleet and an 8-pod trace (shares, whole cards, a multi-card pod, a CPU-only pod)."""
    nodes = tmp_path / "nodes.csv"
    pods = tmp_path / "small_pods.csv"
    nodes.write_text(NODES_CSV)
    pods.write_text(PODS_CSV)
    return nodes, pods
