"""The ledger and the meter on a ManualClock with a scripted usage source: exact totals, idempotency, resume
after a crash, a failed write retried, reports and prices."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from octacloud.core.clock import ManualClock
from octacloud.core.errors import InvalidSpecError
from octacloud.metering import (
    Allocation,
    Ledger,
    Meter,
    Metric,
    PriceSheet,
    Stored,
    Traffic,
    UsageRecord,
    Work,
    report,
    report_totals,
    summarize,
    totals_of,
)

EPOCH = 1_700_000_000.0  # a multiple of 10 s: intervals line up with the clock's start


@dataclass
class FakeSource:
    allocs: list[Allocation] = field(default_factory=list)
    counters: dict[tuple[str, str], Traffic] = field(default_factory=dict)
    replicas: dict[str, Work] = field(default_factory=dict)
    stored: list[Stored] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)
    power: dict[tuple[str, int], float] = field(default_factory=dict)
    """(node, card) → watts it draws now: the fake power sampler."""

    def allocations(self) -> list[Allocation]:
        return list(self.allocs)

    def traffic(self) -> Mapping[tuple[str, str], Traffic]:
        return dict(self.counters)

    async def work(self) -> Mapping[str, Work]:
        return dict(self.replicas)

    def storage(self) -> list[Stored]:
        return list(self.stored)

    def gpu_use(self) -> Mapping[str, int]:
        return dict(self.used)

    def card_power(self) -> Mapping[tuple[str, int], float]:
        return dict(self.power)

    def send(self, tenant: str, deployment: str, requests: int, bytes_in: int, bytes_out: int) -> None:
        t = self.counters.get((tenant, deployment), Traffic())
        self.counters[(tenant, deployment)] = Traffic(
            t.requests + requests, t.bytes_in + bytes_in, t.bytes_out + bytes_out
        )


@pytest.fixture
def ledger(store_url: str) -> Iterator[Ledger]:
    """A ledger on each database (SQLite, then a real PostgreSQL server)."""
    ledger = Ledger.at(store_url)
    yield ledger
    ledger.engine.dispose()


def total(ledger: Ledger, metric: Metric, **where: str) -> int:
    return sum(
        r.quantity for r in ledger.records() if r.metric is metric and all(getattr(r, k) == v for k, v in where.items())
    )


async def run_for(meter: Meter, clock: ManualClock, seconds: float, step: float = 1.0) -> None:
    elapsed = 0.0
    while elapsed < seconds - 1e-9:
        clock.advance(step)
        elapsed += step
        await meter.tick()


async def test_octant_seconds_equal_allocation_times_time(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource([Allocation("a", "web", "web-000001", "H100", 250)])
    meter = Meter(ledger, source, clock, interval_s=10)
    await run_for(meter, clock, 25)
    assert meter.closed == 2  # [0,10) and [10,20) closed; [20,25) open
    assert total(ledger, Metric.ALLOC) == 250 * 20_000
    await meter.flush()
    assert total(ledger, Metric.ALLOC) == 250 * 25_000  # 2 octants × 25 s = 50 octant-seconds
    line = summarize(ledger.records())[0]
    assert line.octant_seconds == 50.0
    starts = [r.interval_start_ms for r in ledger.records()]
    assert starts == [int(EPOCH * 1000), int(EPOCH * 1000) + 10_000, int(EPOCH * 1000) + 20_000]
    # a slice taken mid-interval counts from the sample that saw it: within one tick of the truth
    source.allocs.append(Allocation("b", "api", "api-000002", "H100", 1000))
    await run_for(meter, clock, 7, step=0.5)
    await meter.flush()
    assert total(ledger, Metric.ALLOC, tenant="b") == 1000 * 7_000


async def test_traffic_totals_equal_what_was_sent(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource()
    meter = Meter(ledger, source, clock, interval_s=10)
    await meter.prime()
    sent = {"a": [0, 0, 0], "b": [0, 0, 0]}
    for second in range(37):
        for tenant, n in (("a", 3), ("b", 1)):
            source.send(tenant, "web", n, 100 * n, 40 * n + second)
            sent[tenant] = [sent[tenant][0] + n, sent[tenant][1] + 100 * n, sent[tenant][2] + 40 * n + second]
        clock.advance(1)
        await meter.tick()
    await meter.flush()
    for tenant in ("a", "b"):
        got = [total(ledger, m, tenant=tenant) for m in (Metric.REQUESTS, Metric.BYTES_IN, Metric.BYTES_OUT)]
        assert got == sent[tenant]
        counted = source.counters[(tenant, "web")]  # what the gateway counted reconciles with the ledger
        assert got == [counted.requests, counted.bytes_in, counted.bytes_out]


async def test_replica_work_is_counted_once_across_replica_restarts(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource(replicas={"web-1": Work("a", "web", "H100", 5_000, 50)})  # before the meter: not ours
    meter = Meter(ledger, source, clock, interval_s=10)
    await meter.prime()
    source.replicas["web-1"] = Work("a", "web", "H100", 8_000, 80)
    await run_for(meter, clock, 10)
    source.replicas["web-1"] = Work("a", "web", "H100", 1_000, 10)  # the replica restarted: counters from 0
    source.replicas["web-2"] = Work("a", "web", "H100", 2_000, 20)  # a new replica
    await run_for(meter, clock, 10)
    assert total(ledger, Metric.EXEC) == 3_000 + 1_000 + 2_000
    assert total(ledger, Metric.INFERENCES) == 30 + 10 + 20


async def test_idempotency_keys_make_a_replayed_interval_count_once(ledger: Ledger) -> None:
    records = [UsageRecord("a", "web", "", Metric.REQUESTS, 1000, 10_000, 7)]
    assert ledger.append(records, closed_until_ms=11_000) == 1
    assert ledger.append(records, closed_until_ms=11_000) == 0
    assert ledger.append([*records, UsageRecord("a", "web", "", Metric.REQUESTS, 11_000, 10_000, 2)]) == 1
    assert total(ledger, Metric.REQUESTS) == 9
    assert ledger.closed_until_ms() == 11_000


async def test_a_crash_loses_no_closed_interval_and_a_restart_double_counts_none(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource([Allocation("a", "web", "web-1", "H100", 125)])
    first = Meter(ledger, source, clock, interval_s=10)
    await first.prime()
    for _ in range(25):
        source.send("a", "web", 1, 10, 10)
        clock.advance(1)
        await first.tick()
    closed = ledger.closed_until_ms()
    assert closed == int(EPOCH * 1000) + 20_000
    before = ledger.records()
    # kill -9: the open interval [20, 25) dies with the process (5 requests, 5 s of slice)
    del first
    clock.advance(3)  # down for 3 s: not billed
    second = Meter(ledger, FakeSource(list(source.allocs)), clock, interval_s=10)
    assert second.start_ms == int(EPOCH * 1000) + 28_000
    await second.prime()
    await run_for(second, clock, 12)
    await second.flush()
    after = ledger.records()
    assert after[: len(before)] == before  # closed intervals untouched
    keys = [r.key for r in after]
    assert len(keys) == len(set(keys))
    assert total(ledger, Metric.REQUESTS) == 20
    assert total(ledger, Metric.ALLOC) == 125 * (20_000 + 12_000)
    spans = sorted({(r.interval_start_ms, r.interval_start_ms + r.interval_ms) for r in after})
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end  # never overlapping


async def test_a_failed_write_is_retried_with_the_same_keys(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource([Allocation("a", "web", "web-1", "H100", 125)])
    meter = Meter(ledger, source, clock, interval_s=10)
    await meter.prime()
    real = ledger.append
    failures = {"left": 2}

    def flaky(*args: object, **kwargs: object) -> int:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("database is locked")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger, "append", flaky)
    source.send("a", "web", 4, 40, 40)
    clock.advance(10)
    assert await meter.tick() == 0
    clock.advance(1)
    assert await meter.tick() == 0
    source.send("a", "web", 1, 10, 10)
    clock.advance(1)
    assert await meter.tick() == 1  # the third try wrote [0, 10) with what it held
    await meter.flush()
    assert total(ledger, Metric.REQUESTS) == 5
    assert total(ledger, Metric.ALLOC) == 125 * 12_000


async def test_storage_byte_seconds(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    meter = Meter(ledger, FakeSource(stored=[Stored("a", "web", 1_000_000)]), clock, interval_s=10)
    await run_for(meter, clock, 30)
    assert total(ledger, Metric.STORAGE) == 1_000_000 * 30_000


def test_reports_group_and_price(tmp_path: Path) -> None:
    day = int(EPOCH * 1000)
    records = [
        UsageRecord("a", "web", "web-1", Metric.ALLOC, day, 10_000, 125 * 3_600_000, "H100"),
        UsageRecord("a", "web", "", Metric.BYTES_IN, day, 10_000, 2 * 10**9),
        UsageRecord("a", "api", "api-1", Metric.ALLOC, day + 86_400_000, 10_000, 250 * 3_600_000, "L4"),
        UsageRecord("b", "web", "", Metric.REQUESTS, day, 10_000, 12),
    ]
    sheet = tmp_path / "prices.yaml"
    sheet.write_text("currency: EUR\noctant_hour: {default: 1.0, H100: 4.0}\ngb_transferred: 0.5\n")
    prices = PriceSheet.load(sheet)
    by_deployment = {(line.tenant, line.group): line for line in summarize(records, "deployment", prices)}
    assert by_deployment["a", "web"].octant_hours == 1.0 and by_deployment["a", "web"].cost == 4.0 + 1.0
    assert by_deployment["a", "api"].cost == 2.0
    assert [line.group for line in summarize(records, "day")] == ["2023-11-14", "2023-11-15", "2023-11-14"]
    assert {line.group for line in summarize(records, "gpu-model")} == {"H100", "L4", "-"}
    body = report(records, "tenant", prices)
    assert body["total"]["requests"] == 12 and body["total"]["cost"] == 7.0 and body["currency"] == "EUR"
    with pytest.raises(InvalidSpecError, match="cannot group"):
        summarize(records, "week")
    with pytest.raises(InvalidSpecError, match="unknown field"):
        PriceSheet.from_dict({"octant_hours": 1})
    with pytest.raises(InvalidSpecError, match="gb_transferred"):
        PriceSheet.from_dict({"gb_transferred": -1})


@pytest.mark.parametrize("by", ["deployment", "day", "gpu-model", "tenant"])
def test_the_database_sums_as_the_reports_do(ledger: Ledger, by: str) -> None:
    start = int(EPOCH * 1000) - 3 * 3_600_000  # across a UTC midnight
    records = [
        UsageRecord(t, d, r, m, start + i * 600_000, 600_000, q, model)
        for i in range(40)
        for t, d, r, m, q, model in (
            ("a", "web", "web-1", Metric.ALLOC, 125 * 600_000, "H100"),
            ("a", "web", "", Metric.REQUESTS, 3 + i, ""),
            ("b", "api", "api-1", Metric.ALLOC, 1000 * 600_000, "L4"),
            ("b", "web", "", Metric.BYTES_OUT, 10**6 + i, ""),
        )
    ]
    ledger.append(records)
    assert sorted(ledger.totals(by), key=repr) == sorted(totals_of(records, by), key=repr)
    since, until = start + 600_000, start + 20 * 600_000
    window = [r for r in records if since <= r.interval_start_ms < until and r.tenant == "a"]
    assert sorted(ledger.totals(by, "a", since, until), key=repr) == sorted(totals_of(window, by), key=repr)
    assert report_totals(ledger.totals(by), by) == report(records, by)
    assert ledger.totals(by, deployments=["api"]) == totals_of([r for r in records if r.deployment == "api"], by)


def _requests_in(ledger: Ledger, start_s: float) -> int:
    start_ms = int(start_s * 1000)
    return sum(r.quantity for r in ledger.records() if r.metric is Metric.REQUESTS and r.interval_start_ms == start_ms)


async def test_requests_after_an_interval_ends_count_in_the_next_interval(ledger: Ledger) -> None:
    """The meter closes an interval at its first tick after the end (up to a tick late): what the gateway
    counted in between belongs to the next interval."""
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource()
    meter = Meter(ledger, source, clock, interval_s=10)
    await run_for(meter, clock, 9.0)
    source.send("a", "d", 3, 30, 30)
    clock.advance(0.9)
    await meter.tick()  # 9.9 s: inside the interval
    clock.advance(0.9)  # 10.8 s: the interval ended 0.8 s ago; the meter has not ticked yet
    source.send("a", "d", 5, 50, 50)
    await meter.tick()
    assert meter.closed == 1
    assert _requests_in(ledger, EPOCH) == 3
    await run_for(meter, clock, 10.0)
    assert _requests_in(ledger, EPOCH + 10) == 5
    await meter.flush()
    assert total(ledger, Metric.REQUESTS) == 8


async def test_the_run_loop_marks_just_before_each_end(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH + 3.0)
    meter = Meter(ledger, FakeSource(), clock, interval_s=10)
    assert meter._wait_s(1.0) == 1.0
    clock.advance(6.5)  # 9.5 s into the interval
    assert meter._wait_s(1.0) == pytest.approx(0.495)
    clock.advance(0.497)
    assert meter._wait_s(1.0) == pytest.approx(0.003)


async def test_storage_is_measured_off_the_event_loop(ledger: Ledger) -> None:
    import asyncio
    import threading
    import time

    loop_thread = threading.get_ident()
    seen: list[int] = []

    class SlowStorage(FakeSource):
        def storage(self) -> list[Stored]:
            seen.append(threading.get_ident())
            time.sleep(0.3)
            return [Stored("a", "d", 1)]

    clock = ManualClock(epoch=EPOCH)
    meter = Meter(ledger, SlowStorage(), clock, interval_s=10)
    clock.advance(10)
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(0.01)
            beats += 1

    beating = asyncio.ensure_future(heartbeat())
    await meter.tick()
    beating.cancel()
    assert seen and seen[0] != loop_thread
    assert beats >= 10  # the loop kept running while storage was measured
    assert total(ledger, Metric.STORAGE) == 10_000


def test_folder_measurement_is_bounded(tmp_path: Path) -> None:
    from octacloud.control.usage import folder_bytes

    for i in range(30):
        (tmp_path / f"f{i}").write_bytes(b"x" * 10)
    assert folder_bytes(tmp_path) == 300
    assert folder_bytes(tmp_path, max_files=5) == 50


async def test_the_last_interval_at_shutdown_keeps_traffic_even_when_the_clock_moves_on(ledger: Ledger) -> None:
    """flush() closes at "now"; if the clock passes that millisecond before the close reads the counters (it
    integrates allocations first), the requests since the last mark must still land in this last interval: no
    later interval will ever take them. A fake source that advances the clock while allocations are read."""
    clock = ManualClock(epoch=EPOCH)

    class SlowSource(FakeSource):
        def allocations(self) -> list[Allocation]:
            clock.advance(0.005)  # reading the scheduler's state takes a few milliseconds
            return super().allocations()

    source = SlowSource([Allocation("a", "web", "web-000001", "H100", 125)])
    meter = Meter(ledger, source, clock, interval_s=10)
    await meter.prime()
    clock.advance(2)
    await meter.tick()  # a mark inside the interval, before any request
    source.send("a", "web", 7, 700, 70)
    assert await meter.flush()
    assert total(ledger, Metric.REQUESTS, tenant="a") == 7


async def test_generation_tokens_are_metered_once_per_interval_and_priced_per_million(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource()
    meter = Meter(ledger, source, clock, interval_s=10)
    await meter.prime()
    for second in range(23):  # each second one generation: 11 prompt tokens, second + 1 completion tokens
        counted = source.counters.get(("a", "chat"), Traffic())
        counted = counted.copy()
        counted.bill(500, 80, prompt_tokens=11, completion_tokens=second + 1)
        source.counters[("a", "chat")] = counted
        clock.advance(1)
        await meter.tick()
    await meter.flush()
    await meter.flush()  # a second flush with nothing new writes nothing more
    counted = source.counters[("a", "chat")]
    assert total(ledger, Metric.PROMPT_TOKENS, tenant="a") == counted.prompt_tokens == 23 * 11
    assert total(ledger, Metric.COMPLETION_TOKENS, tenant="a") == counted.completion_tokens == sum(range(1, 24))
    assert total(ledger, Metric.REQUESTS, tenant="a") == 23
    prices = PriceSheet.from_dict({"prompt_mtok": 1.0, "completion_mtok": 4.0})
    line = summarize(ledger.records(), "deployment", prices)[0]
    assert (line.prompt_tokens, line.completion_tokens) == (253, 276)
    assert line.cost == pytest.approx(253 / 1e6 * 1.0 + 276 / 1e6 * 4.0)
    assert report(ledger.records(), "tenant")["total"]["completion_tokens"] == 276
    with pytest.raises(InvalidSpecError, match="completion_mtok"):
        PriceSheet.from_dict({"completion_mtok": -1})
