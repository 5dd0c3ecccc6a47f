"""/metrics shows what the scheduler reads of each node: the same snapshot its telemetry terms score on."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from octacloud.observability.node_inputs import PREFIX, NodeInputsCollector
from octacloud.scheduler.telemetry import KNOWN_METRICS, PricedTelemetry, StaticTelemetry, Tariff

from .test_exporter import documented

NOON = 12 * 3600.0  # 1970-01-01 12:00 UTC


def scrape(collector: NodeInputsCollector) -> dict[str, dict[str, float]]:
    """Family name → node → value."""
    registry = CollectorRegistry()
    registry.register(collector)
    out: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        out[family.name] = {s.labels["node"]: s.value for s in family.samples}
    return out


def priced() -> tuple[StaticTelemetry, PricedTelemetry]:
    measured = StaticTelemetry({"a": {"network_load": 0.25, "power_draw_w": 400.0, "network_latency_us": 31.0},
                                "b": {"network_load": 0.5, "home_grown": 7.0}})  # fmt: skip
    tariffs = {"a": Tariff(((0, 0.10), (8 * 60, 0.30))), "b": Tariff(((0, 0.20),))}
    return measured, PricedTelemetry(measured, tariffs, lambda: NOON)


def test_each_known_metric_is_a_family_with_the_nodes_that_have_it() -> None:
    _, inputs = priced()
    f = scrape(NodeInputsCollector(inputs))
    assert set(f) == {PREFIX + m for m in KNOWN_METRICS}
    assert f["octacloud_node_network_load"] == {"a": 0.25, "b": 0.5}
    assert f["octacloud_node_power_price"] == {"a": 0.30, "b": 0.20}  # noon: a's day price
    assert f["octacloud_node_power_cost"] == {"a": 0.30 * 400.0 / 1000.0}  # b's draw is not measured: no cost
    assert f["octacloud_node_network_latency_us"] == {"a": 31.0}
    assert f["octacloud_node_gpu_utilisation"] == {}  # nobody measured it: an empty family, not a zero


def test_a_metric_outside_the_known_list_is_not_exported() -> None:
    _, inputs = priced()
    assert not any("home_grown" in name for name in scrape(NodeInputsCollector(inputs)))


def test_a_scrape_reads_the_snapshot_now() -> None:
    measured, inputs = priced()
    collector = NodeInputsCollector(inputs)
    assert scrape(collector)["octacloud_node_network_load"]["a"] == 0.25
    measured.update("a", network_load=0.75)  # the sampler's next sample
    measured.update("c", network_load=0.0)  # a node that joined: a zero is a value, and it is shown
    assert scrape(collector)["octacloud_node_network_load"] == {"a": 0.75, "b": 0.5, "c": 0.0}


def test_every_name_and_label_is_documented() -> None:
    docs = documented()
    for name in scrape(NodeInputsCollector(priced()[1])):
        assert name in docs, f"{name} is exported but not documented in docs/monitoring.md"
        assert docs[name] == {"node"}
