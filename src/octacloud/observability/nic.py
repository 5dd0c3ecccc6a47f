"""This host's NIC load: the scheduler's ``network_load``, 0..1.

Between two samples, each interface's bytes received + sent per second (``/proc/net/dev``) over its link speed
(``/sys/class/net/<interface>/speed``, Mb/s); the host's load is the busiest interface's fraction, at most 1.
Loopback, interfaces that are down and interfaces that report no speed (virtual ones, or a driver that does not
know it: the kernel answers -1 or an error) are not counted; with none left, the host reports no load, and the
scheduler's term stays neutral. The files are read through :class:`NetFiles`, so tests give their text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from octacloud.core.clock import Clock

log = logging.getLogger("octacloud.observability.nic")

WRAP_32 = 1 << 32
"""Where a 32-bit kernel's byte counters wrap."""
DOWN_STATES = frozenset({"down", "lowerlayerdown", "notpresent"})
"""``operstate`` values of an interface that carries nothing (``unknown``, which some virtual links report while
they work, counts as up)."""


class NetFiles(Protocol):
    """The two kinds of file the NIC load reads, as text."""

    def net_dev(self) -> str:
        """The text of ``/proc/net/dev``."""
        ...

    def link(self, interface: str, name: str) -> str | None:
        """The text of ``/sys/class/net/<interface>/<name>``, or None when it cannot be read."""
        ...


class HostNetFiles:
    """This host's files (of the network namespace the process runs in)."""

    def __init__(self, proc: Path = Path("/proc/net/dev"), sys: Path = Path("/sys/class/net")) -> None:
        self.proc, self.sys = proc, sys

    def net_dev(self) -> str:
        return self.proc.read_text()

    def link(self, interface: str, name: str) -> str | None:
        try:
            return (self.sys / interface / name).read_text()
        except (OSError, ValueError):  # a down link answers EINVAL for its speed; a gone one, ENOENT
            return None


@dataclass(frozen=True, slots=True)
class Counters:
    rx_bytes: int
    tx_bytes: int


def parse_net_dev(text: str) -> dict[str, Counters]:
    """Interface → its byte counters, from ``/proc/net/dev``'s text; the two header lines and lines that are not
    an interface's (no colon, too few or non-numeric fields) are skipped."""
    out: dict[str, Counters] = {}
    for line in text.splitlines():
        name, colon, rest = line.partition(":")
        fields = rest.split()
        if not colon or len(fields) < 9 or not name.strip() or "|" in name:
            continue
        try:
            out[name.strip()] = Counters(int(fields[0]), int(fields[8]))
        except ValueError:
            continue
    return out


def _delta(now: int, before: int, most: float) -> int | None:
    """Bytes counted since ``before``: a 32-bit counter that wrapped is unwrapped; a counter that went back
    otherwise (the interface was made again) or by more than ``most`` bytes across a wrap gives None."""
    if now >= before:
        return now - before
    if before < WRAP_32:
        wrapped = now + WRAP_32 - before
        if wrapped <= most:
            return wrapped
    return None


class NicLoad:
    """Samples ``files`` at the moments of ``clock``; :meth:`sample` returns the host's load since the last one."""

    def __init__(self, files: NetFiles, clock: Clock) -> None:
        self.files, self.clock = files, clock
        self._last: tuple[float, dict[str, Counters]] | None = None
        self.interfaces: dict[str, float] = {}
        """Interface → its fraction in the last sample (only the interfaces counted)."""

    def sample(self) -> float | None:
        """The busiest counted interface's (received + sent bytes/s) / link speed since the previous sample, at
        most 1; None on the first sample, when the files cannot be read, or when no interface counts."""
        now = self.clock.monotonic()
        try:
            counters = parse_net_dev(self.files.net_dev())
        except OSError as exc:
            log.warning("cannot read the NIC counters: %s", exc)
            self._last, self.interfaces = None, {}
            return None
        last, self._last = self._last, (now, counters)
        self.interfaces = {}
        if last is None or now <= last[0]:
            return None
        elapsed = now - last[0]
        for name, c in counters.items():
            before = last[1].get(name)
            speed = self._speed(name) if before is not None else None
            if speed is None or before is None:
                continue
            capacity = speed * elapsed  # bytes the link carries in the interval
            rx = _delta(c.rx_bytes, before.rx_bytes, 2 * capacity)
            tx = _delta(c.tx_bytes, before.tx_bytes, 2 * capacity)
            if rx is None or tx is None:
                continue
            self.interfaces[name] = min(1.0, (rx + tx) / capacity)
        return max(self.interfaces.values()) if self.interfaces else None

    def _speed(self, interface: str) -> float | None:
        """The link's speed in bytes per second, or None for loopback, a down link or one with no speed."""
        if interface == "lo":
            return None
        state = self.files.link(interface, "operstate")
        if state is not None and state.strip() in DOWN_STATES:
            return None
        text = self.files.link(interface, "speed")
        try:
            mbps = int(text.strip()) if text is not None else 0
        except ValueError:
            return None
        return mbps * 1_000_000 / 8 if mbps > 0 else None
