"""This host's NIC load from /proc/net/dev and /sys/class/net given as text, on a manual clock; and the sampler
giving it to every node of a local fleet."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from octacloud.core import Gpu, Node
from octacloud.core.clock import ManualClock
from octacloud.observability.nic import WRAP_32, Counters, HostNetFiles, NicLoad, parse_net_dev
from octacloud.observability.replicas import ReplicaInfo
from octacloud.observability.telemetry import TelemetrySampler

HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier"
    " compressed\n"
)
MBIT = 1_000_000 // 8
"""Bytes a 1 Mb/s link carries in a second."""


def dev_line(name: str, rx: int, tx: int) -> str:
    return f"{name:>6}: {rx} 10 0 0 0 0 0 0 {tx} 10 0 0 0 0 0 0\n"


class FakeNetFiles:
    """/proc/net/dev's text and each interface's /sys/class/net files (absent: cannot be read)."""

    def __init__(self) -> None:
        self.dev = HEADER
        self.links: dict[str, dict[str, str]] = {}
        self.broken = False

    def counters(self, **interfaces: tuple[int, int]) -> None:
        self.dev = HEADER + "".join(dev_line(name, rx, tx) for name, (rx, tx) in interfaces.items())

    def net_dev(self) -> str:
        if self.broken:
            raise OSError("no /proc/net/dev")
        return self.dev

    def link(self, interface: str, name: str) -> str | None:
        return self.links.get(interface, {}).get(name)


def host(**speeds: str) -> tuple[FakeNetFiles, ManualClock, NicLoad]:
    files, clock = FakeNetFiles(), ManualClock()
    for name, speed in speeds.items():
        files.links[name] = {"operstate": "up\n", "speed": speed + "\n"}
    return files, clock, NicLoad(files, clock)


def test_the_busiest_interface_over_its_link_speed_is_the_load() -> None:
    files, clock, nic = host(eth0="1000", eth1="100")
    files.counters(lo=(0, 0), eth0=(0, 0), eth1=(0, 0))
    assert nic.sample() is None  # one sample: no interval yet
    clock.advance(2.0)
    # eth0: 200 Mb received + 100 Mb sent over 2 s of 1000 Mb/s = 0.15; eth1: 50 Mb + 50 Mb over 2 s of 100 = 0.5
    files.counters(lo=(10**12, 10**12), eth0=(200 * MBIT, 100 * MBIT), eth1=(50 * MBIT, 50 * MBIT))
    assert nic.sample() == pytest.approx(0.5)
    assert nic.interfaces == pytest.approx({"eth0": 0.15, "eth1": 0.5})  # loopback is never counted
    clock.advance(1.0)  # a link carrying more than its speed (counters read late) is full, not more
    files.counters(lo=(0, 0), eth0=(1400 * MBIT, 100 * MBIT), eth1=(50 * MBIT, 50 * MBIT))
    assert nic.sample() == 1.0 and nic.interfaces["eth1"] == 0.0


def test_a_32_bit_counter_that_wrapped_is_unwrapped_and_a_reset_one_is_skipped() -> None:
    files, clock, nic = host(eth0="1000")
    files.counters(eth0=(WRAP_32 - 50 * MBIT, 7))
    nic.sample()
    clock.advance(1.0)
    files.counters(eth0=(50 * MBIT, 7))  # 100 Mb received across the wrap
    assert nic.sample() == pytest.approx(0.1)
    clock.advance(1.0)  # the interface was made again: its counters began at 0, far more than a wrap allows
    files.counters(eth0=(10 * MBIT, 3))
    assert nic.sample() is None and nic.interfaces == {}
    clock.advance(1.0)  # and from there it is measured again
    files.counters(eth0=(110 * MBIT, 3))
    assert nic.sample() == pytest.approx(0.1)


def test_down_links_links_without_speed_and_new_interfaces_are_not_counted() -> None:
    files, clock, nic = host(eth0="1000", eth1="1000", veth0="-1", wlan0="")
    files.links["eth1"]["operstate"] = "down\n"
    files.links["tun0"] = {"operstate": "unknown\n"}  # no speed file (the kernel's EINVAL)
    busy = (500 * MBIT, 500 * MBIT)
    files.counters(eth1=(0, 0), veth0=(0, 0), wlan0=(0, 0), tun0=(0, 0))
    nic.sample()
    clock.advance(1.0)
    files.counters(eth0=busy, eth1=busy, veth0=busy, wlan0=busy, tun0=busy)  # eth0 only now appeared
    assert nic.sample() is None and nic.interfaces == {}
    clock.advance(1.0)
    files.counters(eth0=(600 * MBIT, 500 * MBIT), eth1=busy, veth0=busy, wlan0=busy, tun0=busy)
    assert nic.sample() == pytest.approx(0.1) and set(nic.interfaces) == {"eth0"}


def test_malformed_lines_are_skipped_not_a_crash() -> None:
    text = (
        HEADER + "garbage without a colon\n"
        "  eth0: 12 1 0 0 0 0 0 0 34 1 0 0 0 0 0 0\n"
        "  eth1: 12 1 0\n"  # too few fields
        "  eth2: twelve 1 0 0 0 0 0 0 34 1 0 0 0 0 0 0\n"
        "    : 1 1 0 0 0 0 0 0 1 1 0 0 0 0 0 0\n"  # no name
        "eth3:56 1 0 0 0 0 0 0 78 1 0 0 0 0 0 0\n"  # an old kernel's large counter touching the colon
        "\n"
    )
    assert parse_net_dev(text) == {"eth0": Counters(12, 34), "eth3": Counters(56, 78)}
    files, clock, nic = host(eth0="ten gigabit")  # a speed that is not a number: not counted
    files.dev = text
    nic.sample()
    clock.advance(1.0)
    assert nic.sample() is None


def test_unreadable_counters_report_nothing_and_measuring_starts_again() -> None:
    files, clock, nic = host(eth0="1000")
    files.counters(eth0=(0, 0))
    nic.sample()
    clock.advance(1.0)
    files.broken = True
    assert nic.sample() is None
    files.broken = False
    files.counters(eth0=(900 * MBIT, 0))
    clock.advance(1.0)
    assert nic.sample() is None  # the interval before the failure is not claimed
    files.counters(eth0=(1000 * MBIT, 0))
    clock.advance(1.0)
    assert nic.sample() == pytest.approx(0.1)
    assert nic.sample() is None  # no time passed: no rate


def test_host_files_read_the_given_folders(tmp_path: Path) -> None:
    (tmp_path / "dev").write_text(HEADER + dev_line("eth0", 1, 2))
    (tmp_path / "net" / "eth0").mkdir(parents=True)
    (tmp_path / "net" / "eth0" / "speed").write_text("25000\n")
    files = HostNetFiles(tmp_path / "dev", tmp_path / "net")
    assert parse_net_dev(files.net_dev()) == {"eth0": Counters(1, 2)}
    assert files.link("eth0", "speed") == "25000\n"
    assert files.link("eth0", "operstate") is None and files.link("gone0", "speed") is None


NODES = [Node(n, 4000, 16384, (Gpu(0, "cpu", 1024),)) for n in ("cpu-a", "cpu-b")]


def no_replicas() -> Sequence[ReplicaInfo]:
    return []


def test_every_node_of_a_local_fleet_reports_the_host_load_and_none_without_a_measurement() -> None:
    files, clock, nic = host(eth0="1000")
    files.counters(eth0=(0, 0))
    sampler = TelemetrySampler(lambda: NODES, no_replicas, clock, nic=nic)
    asyncio.run(sampler.sample())
    assert all("network_load" not in m for m in sampler.snapshot().values())  # no interval yet: neutral
    clock.advance(1.0)
    files.counters(eth0=(300 * MBIT, 100 * MBIT))
    asyncio.run(sampler.sample())
    snapshot = sampler.snapshot()
    assert {n: m["network_load"] for n, m in snapshot.items()} == pytest.approx({"cpu-a": 0.4, "cpu-b": 0.4})
    assert "cpu_utilisation" in snapshot["cpu-a"]  # the cards' metrics are kept
    clock.advance(10.0)
    assert sampler.snapshot() == {}  # stale like every other metric
    plain = TelemetrySampler(lambda: NODES, no_replicas, clock)  # no NIC reader (a remote fleet): nothing
    asyncio.run(plain.sample())
    assert all("network_load" not in m for m in plain.snapshot().values())
