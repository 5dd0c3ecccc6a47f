"""Energy in the ledger: each slice is charged its share of its cards' measured draw (milli-GPU / 1000 × watts ×
time), per tenant and deployment next to its octant-seconds; a fake power sampler and a manual clock make the
totals exact. A meter process killed with ``kill -9`` mid-interval loses no closed interval's energy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from octacloud.core.clock import ManualClock
from octacloud.metering import Allocation, Ledger, Meter, Metric, PriceSheet, report, summarize
from tests.metering.test_ledger import EPOCH, FakeSource, run_for, total

ROOT = Path(__file__).resolve().parents[2]
E0 = int(EPOCH * 1000)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger.at(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


async def test_a_slice_is_charged_its_share_of_each_cards_measured_draw(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    source = FakeSource(
        [
            Allocation("acme", "web", "web-aaaaaa", "H100", 500, "n1", (0,)),  # half of n1's card 0
            Allocation("globex", "api", "api-bbbbbb", "H100", 250, "n1", (0,)),  # a quarter of the same card
            Allocation("acme", "big", "big-cccccc", "H100", 1000, "n2", (0, 1)),  # half of each of n2's two cards
            Allocation("globex", "cpu", "cpu-dddddd", "cpu", 125, "n3", (0,)),  # a card whose draw nobody measures
        ],
        power={("n1", 0): 400.0, ("n2", 0): 300.0, ("n2", 1): 200.0},
    )
    meter = Meter(ledger, source, clock, interval_s=10)
    await run_for(meter, clock, 10)
    source.power[("n1", 0)] = 100.0  # the card's draw falls: the next 10 s are charged at the new draw
    await run_for(meter, clock, 10)
    assert meter.closed == 2
    assert total(ledger, Metric.ENERGY, deployment="web") == 400 * 500 // 1000 * 10_000 + 100 * 500 // 1000 * 10_000
    assert total(ledger, Metric.ENERGY, deployment="api") == 400 * 250 // 1000 * 10_000 + 100 * 250 // 1000 * 10_000
    assert total(ledger, Metric.ENERGY, deployment="big") == (300 + 200) * 500 // 1000 * 20_000
    assert total(ledger, Metric.ENERGY, deployment="cpu") == 0  # no record at all for an unmeasured card
    assert total(ledger, Metric.ALLOC, deployment="cpu") == 125 * 20_000  # its slice is still billed
    # the second tenant on the card is charged its own quarter, never the first tenant's half
    by_tenant = {line.tenant: line for line in summarize(ledger.records(), by="tenant")}
    assert by_tenant["acme"].energy_mj == 2_500_000 + 5_000_000
    assert by_tenant["globex"].energy_mj == 1_250_000
    lines = {(line["tenant"], line["group"]): line for line in report(ledger.records(), "deployment")["lines"]}
    assert lines["acme", "big"]["energy_wh"] == pytest.approx(5_000_000 / 3_600_000, abs=1e-6)
    assert lines["acme", "web"]["octant_seconds"] == 80.0  # next to the octant-seconds: 4 octants for 20 s
    assert report(ledger.records(), "tenant")["total"]["energy_wh"] == pytest.approx(8_750_000 / 3_600_000, abs=1e-6)
    priced = summarize(ledger.records(), "tenant", PriceSheet.from_dict({"kwh": 0.5}))
    kwh = {"acme": 7_500_000 / 3_600_000 / 1000, "globex": 1_250_000 / 3_600_000 / 1000}  # 1 kWh = 3.6e9 mJ
    assert {line.tenant: line.cost for line in priced} == pytest.approx({t: q * 0.5 for t, q in kwh.items()})


async def test_readings_that_are_no_wattage_charge_nothing(ledger: Ledger) -> None:
    clock = ManualClock(epoch=EPOCH)
    slices = [Allocation("acme", "web", f"web-00000{i}", "H100", 1000, "n1", (i,)) for i in range(3)]
    power = {("n1", 0): float("nan"), ("n1", 1): -5.0, ("n1", 2): float("inf")}
    meter = Meter(ledger, FakeSource(slices, power=power), clock, interval_s=10)
    await run_for(meter, clock, 10)
    assert meter.closed == 1
    assert total(ledger, Metric.ENERGY) == 0
    assert total(ledger, Metric.ALLOC) == 3 * 1000 * 10_000


class MeterProcess:
    """``tests/metering/meter_process.py`` as a child process, driven over its stdin."""

    def __init__(self, url: str, epoch: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.metering.meter_process", url, str(epoch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )

    def say(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the meter process died (exit {self.proc.poll()})"
        return answer


@contextmanager
def meter_process(url: str, epoch: float) -> Iterator[MeterProcess]:
    child = MeterProcess(url, epoch)
    try:
        yield child
    finally:
        if child.proc.poll() is None:
            child.proc.kill()  # our own child, by its PID
        child.proc.wait(timeout=60)
        for pipe in (child.proc.stdin, child.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_kill_9_mid_interval_loses_no_closed_energy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with meter_process(url, EPOCH) as first:
        assert first.say("power n1 0 400") == "ok"
        answers = [first.say("tick 1") for _ in range(25)]
        assert answers[-1] == "closed 2"  # [0, 10) and [10, 20) closed; [20, 25) open
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=60)
        assert first.proc.returncode == -signal.SIGKILL
    ledger = Ledger.at(url)
    before = ledger.records()
    assert ledger.closed_until_ms() == E0 + 20_000
    assert total(ledger, Metric.ENERGY, tenant="acme") == 400 * 500 // 1000 * 20_000
    assert total(ledger, Metric.ENERGY, tenant="globex") == 400 * 250 // 1000 * 20_000
    # down for 3 s after 25 s: the open interval died with the process, the downtime is not billed
    with meter_process(url, EPOCH + 28) as second:
        assert second.say("power n1 0 400") == "ok"
        assert [second.say("tick 1") for _ in range(12)][-1] == "closed 2"  # [28, 30) and [30, 40)
    after = ledger.records()
    assert after[: len(before)] == before  # closed intervals untouched
    assert len({r.key for r in after}) == len(after)
    assert total(ledger, Metric.ENERGY, tenant="acme") == 400 * 500 // 1000 * (20_000 + 12_000)
    assert total(ledger, Metric.ALLOC, tenant="acme") == 500 * (20_000 + 12_000)
    ledger.close()
