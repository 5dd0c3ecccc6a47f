"""Where the tests find the openb traces: the folder ``$OCTACLOUD_TRACES`` names, and nowhere else.

docs/simulator.md says where the traces come from and how to fetch them. Tests that need them skip, saying
why, when the variable is unset or names a folder without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TRACES_ENV = "OCTACLOUD_TRACES"
FLEET_FILE = "openb_node_list_gpu_node.csv"


def traces_dir() -> Path | None:
    """The openb folder, or ``None`` when ``$OCTACLOUD_TRACES`` is unset or lacks the fleet file."""
    env = os.environ.get(TRACES_ENV)
    if not env:
        return None
    path = Path(env)
    return path if (path / FLEET_FILE).is_file() else None


def require_traces() -> Path:
    """The openb folder, or skip the test saying exactly what is missing."""
    path = traces_dir()
    if path is None:
        env = os.environ.get(TRACES_ENV)
        if not env:
            pytest.skip(f"the openb traces are not available: {TRACES_ENV} is not set (see docs/simulator.md)")
        pytest.skip(f"the openb traces are not available: {TRACES_ENV}={env} has no {FLEET_FILE}")
    return path
