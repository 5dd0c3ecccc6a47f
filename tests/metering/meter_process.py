"""A meter as a process of its own, for the ``kill -9`` tests: a scripted usage source on a manual clock, driven
line by line on stdin, so that the test decides when it dies and nothing depends on timing.

``python -m tests.metering.meter_process LEDGER_URL EPOCH`` then, on stdin, ``tick SECONDS`` (advance the clock,
tick; answers ``closed N`` with the intervals closed so far) and ``power NODE CARD WATTS`` (the card's draw from
now; answers ``ok``). The slices are :data:`SLICES`.
"""

from __future__ import annotations

import asyncio
import sys

from octacloud.core.clock import ManualClock
from octacloud.metering import Allocation, Ledger, Meter
from tests.metering.test_ledger import FakeSource

SLICES = [
    Allocation("acme", "web", "web-aaaaaa", "H100", 500, "n1", (0,)),
    Allocation("globex", "api", "api-bbbbbb", "H100", 250, "n1", (0,)),
]


async def main(url: str, epoch: float) -> None:
    clock = ManualClock(epoch=epoch)
    source = FakeSource(list(SLICES))
    meter = Meter(Ledger.at(url), source, clock, interval_s=10)
    await meter.prime()
    for line in sys.stdin:
        verb, *args = line.split()
        if verb == "tick":
            clock.advance(float(args[0]))
            await meter.tick()
            print(f"closed {meter.closed}", flush=True)
        elif verb == "power":
            source.power[args[0], int(args[1])] = float(args[2])
            print("ok", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
