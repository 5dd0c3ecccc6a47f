"""Measured network inputs with a scripted round trip: the route table prefers the nearer replica when loads are
equal (never over a less loaded one), the nodes' ``network_latency_us`` feeds the scheduler's telemetry, and a
route over the 50 µs budget is reported once (event and metric) and once more when it comes back."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from octacloud.gateway.latency import LATENCY_BUDGET_US, RouteLatency, RouteLatencyCollector, TcpHandshake
from octacloud.gateway.routing import LATENCY_TIE_US, Endpoint, RouteTable
from octacloud.gateway.sharing import ShareError, apply_snapshot, route_snapshot
from octacloud.scheduler.telemetry import MeasuredNetwork, PricedTelemetry, StaticTelemetry, Tariff


class ScriptedRoundTrip:
    """Host → the round trip it answers with (None: unreachable); counts the calls."""

    def __init__(self, rtt: dict[str, int | None]) -> None:
        self.rtt = rtt
        self.calls: list[tuple[str, int]] = []

    def rtt_us(self, host: str, port: int) -> int | None:
        self.calls.append((host, port))
        return self.rtt[host]


def two_racks() -> RouteTable:
    table = RouteTable(rng=random.Random(7))
    table.update("m", [Endpoint("m-near", "10.0.1.2", 8001, 9001), Endpoint("m-far", "10.0.2.2", 8001, 9001)])
    return table


def test_equal_loads_go_to_the_lower_measured_latency_unequal_to_the_less_loaded() -> None:
    table = two_racks()
    near, far = table.routes["m"]
    table.latency_us = {"m-near": 20, "m-far": 1200}
    assert all(table.choose("m") is near for _ in range(50))
    near.outstanding = 1  # the near one is busier: load first, latency only breaks ties
    assert all(table.choose("m") is far for _ in range(50))
    near.outstanding = 0
    for unknown in ({"m-far": 1200}, {}, {"m-near": 20, "m-far": 20 + LATENCY_TIE_US}):
        table.latency_us = unknown  # one not measured, none, or no difference the measurement can tell: the draw
        assert {table.choose("m").replica_id for _ in range(50)} == {"m-near", "m-far"}  # type: ignore[union-attr]
    table.latency_us = {"m-near": 20, "m-far": 21 + LATENCY_TIE_US}
    assert all(table.choose("m") is near for _ in range(50))
    assert table.choose("m", exclude=["m-near"]) is far


async def test_a_route_over_the_budget_is_reported_once_and_once_when_it_comes_back() -> None:
    table = two_racks()
    events: list[tuple[str, str, str]] = []
    rtt = ScriptedRoundTrip({"10.0.1.2": 18, "10.0.2.2": 1200})
    latency = RouteLatency(
        table, rtt, nodes=lambda: {"m-near": "rack-a-1", "m-far": "rack-b-1"}, on_report=lambda *e: events.append(e)
    )
    await latency.measure()
    assert sorted(rtt.calls) == [("10.0.1.2", 8001), ("10.0.2.2", 8001)]  # each replica's HTTP port
    assert table.latency_us == {"m-near": 18, "m-far": 1200}
    assert latency.node_latency_us() == {"rack-a-1": 18.0, "rack-b-1": 1200.0}
    assert [(d, r) for d, r, _ in events] == [("m", "m-far")]
    assert "1200 µs" in events[0][2] and f"{LATENCY_BUDGET_US} µs budget" in events[0][2]
    await latency.measure()
    assert len(events) == 1 and latency.reports == 1  # still over: not reported again
    text = metrics(latency)
    assert 'octacloud_route_latency_us{deployment="m",node="rack-b-1",replica="m-far"} 1200.0' in text
    assert "octacloud_routes_over_latency_budget 1.0" in text
    rtt.rtt["10.0.2.2"] = 30
    await latency.measure()
    assert [r for _, r, _ in events] == ["m-far", "m-far"] and "within the budget again" in events[1][2]
    assert "octacloud_routes_over_latency_budget 0.0" in metrics(latency)


async def test_replicas_on_one_host_share_one_measurement_of_its_path() -> None:
    table = two_racks()
    table.update("m", [*table.routes["m"], Endpoint("m-near2", "10.0.1.2", 8003, 9003)])
    table.update("api", [Endpoint("api-near", "10.0.1.2", 8005, 9005)])
    rtt = ScriptedRoundTrip({"10.0.1.2": 18, "10.0.2.2": 1200})
    await RouteLatency(table, rtt).measure()
    assert sorted(rtt.calls) == [("10.0.1.2", 8001), ("10.0.2.2", 8001)]  # one handshake series per host
    assert table.latency_us == {"m-near": 18, "m-near2": 18, "api-near": 18, "m-far": 1200}

    class FirstDead(ScriptedRoundTrip):
        def rtt_us(self, host: str, port: int) -> int | None:
            self.calls.append((host, port))
            return None if port == 8001 else self.rtt[host]

    dead = FirstDead({"10.0.1.2": 18, "10.0.2.2": 1200})
    await RouteLatency(table, dead).measure()
    near_calls = [port for host, port in dead.calls if host == "10.0.1.2"]
    assert near_calls == [8001, 8003]  # the host's next replica measures it
    assert table.latency_us["m-near2"] == 18 and "m-far" not in table.latency_us


async def test_an_unreachable_route_is_neither_preferred_nor_reported() -> None:
    table = two_racks()
    events: list[tuple[str, str, str]] = []
    latency = RouteLatency(
        table, ScriptedRoundTrip({"10.0.1.2": None, "10.0.2.2": 40}), on_report=lambda *e: events.append(e)
    )
    await latency.measure()
    assert table.latency_us == {"m-far": 40} and events == []
    assert latency.node_latency_us() == {}  # nodes unknown: routing uses it, the scheduler does not
    with pytest.raises(ValueError, match="budget"):
        RouteLatency(table, budget_us=0)
    with pytest.raises(ValueError, match="tries"):
        TcpHandshake(tries=0)


async def test_a_failing_report_or_meter_costs_nothing_else() -> None:
    class Broken:
        def rtt_us(self, host: str, port: int) -> int | None:
            if host == "10.0.1.2":
                raise RuntimeError("boom")
            return 900

    def report(*_: str) -> None:
        raise RuntimeError("event store down")

    table = two_racks()
    latency = RouteLatency(table, Broken(), on_report=report)
    await latency.measure()
    assert table.latency_us == {"m-far": 900} and latency.over == {"m-far"}
    table.remove("m")  # the deployment is gone: its routes are forgotten, nothing is over the budget
    await latency.measure()
    assert latency.over == set() and latency.measured == {} and table.latency_us == {}


def test_the_nodes_latency_is_the_schedulers_network_latency_us() -> None:
    source = StaticTelemetry({"rack-a-1": {"gpu_utilisation": 0.5}})
    measured = {"rack-a-1": 18.0, "rack-b-1": 1200.0}
    network = MeasuredNetwork(source, lambda: measured)
    snapshot = network.snapshot()
    assert snapshot == {
        "rack-a-1": {"gpu_utilisation": 0.5, "network_latency_us": 18.0},
        "rack-b-1": {"network_latency_us": 1200.0},
    }
    assert network.snapshot() is snapshot  # the same inputs: the same snapshot
    assert source.snapshot() == {"rack-a-1": {"gpu_utilisation": 0.5}}  # the source is not written to
    priced = PricedTelemetry(network, {"rack-b-1": Tariff(((0, 0.2),))}, lambda: 0.0).snapshot()
    assert priced["rack-b-1"] == {"network_latency_us": 1200.0, "power_price": 0.2}
    assert MeasuredNetwork(source, dict).snapshot() is source.snapshot()


def test_gateway_workers_get_the_latencies_with_the_routes() -> None:
    main = two_racks()
    main.latency_us = {"m-near": 18, "m-far": 1200}
    worker = RouteTable()
    apply_snapshot(worker, route_snapshot(main))
    assert worker.latency_us == {"m-near": 18, "m-far": 1200}
    snapshot = route_snapshot(main)
    del snapshot["latency"]  # a main process of an older version
    apply_snapshot(worker, snapshot)
    assert worker.latency_us == {}
    for bad in ({"m-near": -1}, {"m-near": "fast"}, ["m-near"]):
        with pytest.raises(ShareError, match="latency|integer"):
            apply_snapshot(worker, {**route_snapshot(main), "latency": bad})


def metrics(latency: RouteLatency) -> str:
    registry = CollectorRegistry()
    registry.register(RouteLatencyCollector(latency))
    return generate_latest(registry).decode()
