"""Time comes from an injected clock, so batching, health checks and the 5 s loop are testable."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of time.

    Implementations guarantee that :meth:`monotonic` never decreases, and that :meth:`time` is seconds
    since the Unix epoch (it may jump with the wall clock).
    """

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to: for tests and simulations."""

    def __init__(self, start: float = 0.0, epoch: float = 1_700_000_000.0) -> None:
        self._now = start
        self._epoch = epoch

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._epoch + self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (advance by {seconds})")
        self._now += seconds
