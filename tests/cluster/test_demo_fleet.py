"""The demo fleet: a host without GPUs shows up as several nodes of several CPU cards, declared as such."""

from __future__ import annotations

import pytest

from octacloud.control.fleet import CPU_CARD_MODEL, DEMO_LABEL, _host_memory_mib, demo_fleet, discover_fleet
from octacloud.core.errors import InvalidSpecError


def test_two_nodes_of_four_cards_carved_out_of_this_host() -> None:
    nodes = demo_fleet(2, 4, host="here")
    assert [n.name for n in nodes] == ["demo-a", "demo-b"]
    assert all(n.gpu_count == 4 and n.gpu_model == CPU_CARD_MODEL for n in nodes)
    assert all(n.labels[DEMO_LABEL] == "here" and n.labels["octacloud.io/accelerator"] == "cpu" for n in nodes)
    cards = [g.memory_mib for n in nodes for g in n.gpus]
    assert len(set(cards)) == 1 and sum(cards) <= _host_memory_mib() // 2  # the cards share half the host's memory
    assert sum(n.memory_mib for n in nodes) <= _host_memory_mib()
    assert all(n.cpu_milli >= 1000 for n in nodes)


@pytest.mark.parametrize(("nodes", "cards"), [(0, 4), (27, 1), (2, 0), (2, 65)])
def test_impossible_demo_fleets_are_refused(nodes: int, cards: int) -> None:
    with pytest.raises(InvalidSpecError, match="a demo"):
        demo_fleet(nodes, cards)


def test_discover_without_gpus_gives_the_host_or_a_demo_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("octacloud.control.fleet.nvml_host_node", lambda: None)
    (host,) = discover_fleet(cpu_cards=2)
    assert host.gpu_count == 2 and DEMO_LABEL not in host.labels
    demo = discover_fleet(cpu_cards=4, cpu_nodes=3)
    assert [n.name for n in demo] == ["demo-a", "demo-b", "demo-c"] and all(n.gpu_count == 4 for n in demo)
