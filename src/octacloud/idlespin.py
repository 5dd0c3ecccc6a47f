"""Idle spinning: an event loop that keeps polling for a short while after it last did work, instead of
putting its core to sleep at once.

A request through octacloud hops between processes (client → gateway → replica and back), and each hop wakes
the process it lands in. Where waking an idle core is slow, those wake-ups are the cost: on the 2-core virtual
machines the benchmarks ran on, a round trip between two processes on different cores took 221 µs and about
180 µs of CPU against 17 µs on one core (``bench/compute_process.py``). Machines with deep CPU idle states
behave alike (a core leaves C6 in tens of microseconds). The kernel's answer is polling before halting
(``cpuidle-haltpoll``, ``idle=poll``); this is the same for one event loop, bounded and opt-in.

``OCTACLOUD_GATEWAY_SPIN_US`` and ``OCTACLOUD_REPLICA_SPIN_US`` (microseconds; 0 or unset: off) install an
:class:`IdleSpin` on the loop of gateway processes and of replica processes. They are apart because spinning
pays only for a process with a core of its own: a replica that shares its core with other work would take the
polls' time from it. Each time the loop receives data (the servers' and the gateway's protocols call
:func:`poke`, and the batcher does when a batch is done), it keeps polling with a zero timeout until the window
has passed since the end of that turn; then it sleeps as before. An idle server costs nothing; a busy one spends
at most the window's CPU after each burst of work and answers the next request without being woken. Measure
before turning it on: it pays only where a wake-up costs more than the polling.

Mechanism only: the window is the operator's; :class:`IdleSpin` takes a clock for tests. It reads the
environment and drives an event loop, so it sits outside the pure ``core/``, below ``serving/`` (the batcher
pokes it) and the protocols.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

GATEWAY_SPIN_ENV = "OCTACLOUD_GATEWAY_SPIN_US"
"""The spin window of gateway processes (``octacloud up``'s and its gateway workers')."""
REPLICA_SPIN_ENV = "OCTACLOUD_REPLICA_SPIN_US"
"""The spin window of replica processes (``octacloud serve``, local or on Ray)."""
MAX_SPIN_US = 100_000


def window_us_from_env(name: str) -> int:
    """The spin window in µs that the variable ``name`` sets, 0 (off) when unset; a bad value is an error
    naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of microseconds (0 turns spinning off), got {raw!r}") from None
    if not 0 <= value <= MAX_SPIN_US:
        raise ValueError(f"{name} must be between 0 and {MAX_SPIN_US} microseconds, got {value}")
    return value


class IdleSpin:
    """Keeps ``loop`` polling until ``window_us`` has passed since the end of the last turn in which it was
    poked; :meth:`poke` (re)starts it. The window counts from the end of the turn, not from the poke, so that
    the work the data caused in that turn is not counted as idle time."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        window_us: int,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if window_us <= 0:
            raise ValueError("the spin window must be positive")
        self._loop = loop
        self._window_ns = window_us * 1000
        self._clock = clock_ns
        self._until = 0
        self._poked = False
        self.running = False
        self.ticks = 0

    def poke(self) -> None:
        """Work arrived: keep polling for the window after this turn."""
        self._poked = True
        if not self.running and not self._loop.is_closed():
            self.running = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        now = self._clock()
        if self._poked:
            self._poked = False
            self._until = now + self._window_ns
        self.ticks += 1
        if now < self._until:
            self._loop.call_soon(self._tick)  # a ready callback makes the next poll return at once
        else:
            self.running = False


_current: IdleSpin | None = None


def install(loop: asyncio.AbstractEventLoop, window_us: int) -> IdleSpin | None:
    """Spin ``loop`` (this process's server loop) with ``window_us``; 0 removes spinning. Returns the spinner."""
    global _current
    _current = IdleSpin(loop, window_us) if window_us > 0 else None
    return _current


def poke() -> None:
    """Called by protocols when data arrives: a no-op unless spinning is installed."""
    if _current is not None:
        _current.poke()


__all__ = ["GATEWAY_SPIN_ENV", "REPLICA_SPIN_ENV", "IdleSpin", "install", "poke", "window_us_from_env"]
