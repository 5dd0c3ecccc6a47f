"""Fleet files are validated with errors naming the node and key; the CPU host is a node of CPU cards."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.control.fleet import CPU_CARD_MODEL, FleetHealth, cpu_host_node, discover_fleet, load_fleet_file
from octacloud.core import Health, InvalidSpecError, ManualClock

FLEET = """
nodes:
  - name: gpu-a
    cpu_milli: 64000
    memory_mib: 262144
    labels: {zone: a}
    gpus:
      - {model: A100, memory_mib: 81920, nvlink_group: 0}
      - {model: A100, memory_mib: 81920, nvlink_group: 0, health: degraded}
  - name: gpu-b
    cpu_milli: 32000
    memory_mib: 131072
    gpu_count: 8
    gpu_model: T4
    gpu_memory_mib: 16384
"""


def test_fleet_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    a, b = discover_fleet(path)
    assert a.name == "gpu-a" and a.labels["zone"] == "a"
    assert [g.nvlink_group for g in a.gpus] == [0, 0]
    assert a.gpus[1].health is Health.DEGRADED
    assert b.gpu_count == 8 and b.gpu_model == "T4" and b.gpus[7].memory_mib == 16384


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: 3", "top-level 'nodes:' list"),
        ("nodes:\n  - {name: x, cpu_milli: 1, memory_mib: 1, gpu: 2}", r"node 'x': unknown key\(s\) \['gpu'\]"),
        ("nodes:\n  - {name: x, cpu_milli: lots, memory_mib: 1}", "node 'x': cpu_milli: expected an integer"),
        ("nodes:\n  - {name: x, cpu_milli: 1, memory_mib: 1, gpu_count: 2}", "'gpu_model' is required"),
        (
            "nodes:\n  - {name: x, cpu_milli: 1, memory_mib: 1}\n  - {name: x, cpu_milli: 1, memory_mib: 1}",
            "duplicate node name",
        ),
        ("nodes:\n  - {name: x, cpu_milli: 1, memory_mib: 1, gpus: [{model: T4}]}", r"gpus\[0\]: memory_mib"),
        ("nodes: [", "not valid YAML"),
    ],
)
def test_bad_fleet_files_name_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(InvalidSpecError, match=message):
        load_fleet_file(path)


def test_missing_fleet_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="cannot read fleet file"):
        load_fleet_file(tmp_path / "nope.yaml")


def test_cpu_host_node() -> None:
    node = cpu_host_node("here", cards=2)
    assert node.name == "here" and node.gpu_count == 2
    assert all(g.model == CPU_CARD_MODEL for g in node.gpus)
    assert node.cpu_milli >= 1000 and node.gpus[0].memory_mib > 0


def test_health_history() -> None:
    clock = ManualClock()
    health = FleetHealth(clock)
    assert not health.observe("n", Health.HEALTHY)  # nodes start healthy: no transition
    clock.advance(3)
    assert health.observe("n", Health.FAILED, "heartbeat lost")
    assert health.health("n") is Health.FAILED
    assert [(e.health, e.reason) for e in health.history] == [(Health.FAILED, "heartbeat lost")]
