"""Power as a cost: a tariff per node and time of day from the fleet file, times the measured draw, as the
``power_price`` and ``power_cost`` telemetry the scheduler's terms score on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from octacloud.control.fleet import fleet_tariffs, parse_tariff
from octacloud.core import InvalidSpecError
from octacloud.core.clock import ManualClock
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import build_profile
from octacloud.scheduler.telemetry import PricedTelemetry, StaticTelemetry, Tariff
from tests.scheduler.helpers import node, req

DAY = Tariff(((0, 0.10), (7 * 60, 0.30), (22 * 60, 0.10)))


@pytest.mark.parametrize(
    ("hhmm", "price"), [("00:00", 0.10), ("06:59", 0.10), ("07:00", 0.30), ("21:59", 0.30), ("22:00", 0.10)]
)
def test_a_price_holds_from_its_time_until_the_next(hhmm: str, price: float) -> None:
    h, m = map(int, hhmm.split(":"))
    assert DAY.price_at(86400 * 3 + h * 3600 + m * 60 + 30) == price


def test_before_the_first_step_the_last_price_holds() -> None:
    assert Tariff(((6 * 60, 0.2), (18 * 60, 0.5))).price_at(3 * 3600) == 0.5


def test_the_fleet_file_tariff_quoted_or_as_yaml_reads_unquoted_times() -> None:
    quoted = parse_tariff({"00:00": 0.1, "07:00": 0.3, "22:00": 0.1}, "t")
    unquoted = parse_tariff(yaml.safe_load("{00:00: 0.1, 07:00: 0.3, 22:00: 0.1}"), "t")  # base-60 integers
    assert quoted == unquoted == Tariff(((0, 0.1), (420, 0.3), (1320, 0.1)))


@pytest.mark.parametrize(
    ("tariff", "message"),
    [
        ({}, 'expected a mapping of "HH:MM" to a price per kWh'),
        ({"7am": 0.1}, "'7am' is not a time of day"),
        ({"24:00": 0.1}, "'24:00' is not a time of day"),
        ({"07:00": -1}, "07:00: the price must be a number >= 0, got -1"),
        ({"07:00": "cheap"}, "the price must be a number"),
        ({"07:00": 0.1, 420: 0.2}, "a time of day is given twice"),
    ],
)
def test_bad_tariffs_are_refused_naming_node_and_key(tariff: object, message: str) -> None:
    doc = {"nodes": [{"name": "n", "cpu_milli": 1, "memory_mib": 1, "tariff": tariff}]}
    with pytest.raises(InvalidSpecError, match=r"node 'n': tariff: .*" + re.escape(message)):
        fleet_tariffs(doc)


def test_price_and_cost_join_the_measured_telemetry() -> None:
    clock = ManualClock(start=8 * 3600, epoch=0)  # 08:00 UTC
    measured = StaticTelemetry({"a": {"power_draw_w": 2000.0}, "b": {"gpu_utilisation": 0.5}})
    priced = PricedTelemetry(measured, {"a": DAY, "b": DAY}, clock.time)
    snap = priced.snapshot()
    assert snap["a"] == {"power_draw_w": 2000.0, "power_price": 0.30, "power_cost": pytest.approx(0.60)}
    assert snap["b"] == {"gpu_utilisation": 0.5, "power_price": 0.30}  # no measured draw: no cost
    assert measured.snapshot()["a"] == {"power_draw_w": 2000.0}  # the source's snapshot is left as it was
    assert priced.snapshot() is snap  # same sample, same minute: computed once
    clock.advance(15 * 3600)  # 23:00
    assert priced.snapshot()["a"]["power_cost"] == pytest.approx(0.20)


def test_the_cheaper_node_now_wins_and_the_choice_follows_the_time_of_day(tmp_path: Path) -> None:
    profile = tmp_path / "power.yaml"
    profile.write_text(
        "name: power\nplugins:\n  - resource-fit\n  - plugin: telemetry\n    args: {metric: power_cost, prefer: low}\n"
    )
    clock = ManualClock(start=12 * 3600, epoch=0)  # noon
    night_cheap = Tariff(((0, 0.05), (7 * 60, 0.40), (22 * 60, 0.05)))
    flat = Tariff(((0, 0.20),))
    measured = StaticTelemetry({"a": {"power_draw_w": 1000.0}, "b": {"power_draw_w": 1000.0}})
    priced = PricedTelemetry(measured, {"a": night_cheap, "b": flat}, clock.time)
    s = Scheduler(ClusterState([node("a"), node("b")]), build_profile(str(profile), seed=0, telemetry=priced))
    assert s.decide(req("p", 500)).placement.node == "b"  # type: ignore[union-attr]
    clock.advance(11 * 3600)  # 23:00: a's night price
    assert s.decide(req("p", 500)).placement.node == "a"  # type: ignore[union-attr]
