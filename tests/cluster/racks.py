"""Racks as network namespaces for tests: each rack is a namespace of its own (held open by a ``sleep`` started
under ``unshare --net``), joined to the test's namespace by a veth pair whose gateway end delays what it sends
with ``tc netem``. On a kernel built without netem (``sch_netem``) a delayed rack's link is instead a pair of TUN
devices with ``tests/cluster/tun_delay.py`` between them, holding each packet towards the rack for the delay.
Nothing is named in ``ip netns`` (the namespaces are anonymous: they end with their holder), and the test's own
namespace must be a private loopback-only one (``scripts/netns-run``), so no address of these links is
reachable from, or reaches, anything else.

Rack ``i`` (from 1) is ``10.231.i.2``; the gateway's end of its link is ``10.231.i.1``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

TOOLS = ("ip", "tc", "unshare", "nsenter")
ROOT = Path(__file__).resolve().parents[2]


def skip_without_namespaces() -> None:
    """Skip (saying why) unless this process may make namespaces and links, and runs in a private namespace whose
    only interface is loopback (links made elsewhere would join the machine's own network)."""
    if os.geteuid() != 0:
        pytest.skip("racks need root: network namespaces, veth pairs and tc netem")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"racks need {', '.join(missing)} (iproute2, util-linux)")
    links = run(["ip", "-o", "link", "show"]).splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in links if line.strip()]
    if names != ["lo"]:
        pytest.skip(f"racks are built only inside a private loopback-only namespace (scripts/netns-run); here: {names}")


def run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass
class Rack:
    name: str
    index: int
    holder: subprocess.Popen[bytes]
    delay_us: int
    forwarder: subprocess.Popen[str] | None = None
    """The TUN link's delaying process (None: a veth pair)."""

    @property
    def address(self) -> str:
        return f"10.231.{self.index}.2"

    @property
    def link(self) -> str:
        return f"oc-rack{self.index}"

    def inside(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this rack's namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *argv]


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has netem (tried on the loopback of a namespace made for the question)."""
    argv = ["unshare", "--net", "--", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


def _veth(rack: Rack) -> None:
    run(["ip", "link", "add", rack.link, "type", "veth", "peer", "name", "eth0", "netns", str(rack.holder.pid)])
    run(["ip", "addr", "add", f"10.231.{rack.index}.1/30", "dev", rack.link])
    run(rack.inside(["ip", "addr", "add", f"{rack.address}/30", "dev", "eth0"]))
    if rack.delay_us:
        run(["tc", "qdisc", "add", "dev", rack.link, "root", "netem", "delay", f"{rack.delay_us}us"])


def _tun(rack: Rack) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    argv = [sys.executable, "-m", "tests.cluster.tun_delay", rack.link, str(rack.holder.pid), str(rack.delay_us)]
    rack.forwarder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert rack.forwarder.stdout is not None
    if rack.forwarder.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the delaying link of {rack.name} did not start (exit {rack.forwarder.poll()})")
    run(["ip", "addr", "add", f"10.231.{rack.index}.1", "peer", f"{rack.address}/32", "dev", rack.link])
    run(rack.inside(["ip", "addr", "add", rack.address, "peer", f"10.231.{rack.index}.1/32", "dev", "eth0"]))


def _own_namespace(pid: int) -> None:
    """Wait until ``pid`` (just started under ``unshare --net``) is in a namespace of its own."""
    here = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 30  # a deadline against a hang, not a timing
    while os.readlink(f"/proc/{pid}/ns/net") == here:
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} never entered a network namespace of its own")
        time.sleep(0.01)


def _make(name: str, index: int, delay_us: int) -> Rack:
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "3600"])
    rack = Rack(name, index, holder, delay_us)
    try:
        _own_namespace(holder.pid)
        (_tun if delay_us and not netem_available() else _veth)(rack)
        run(["ip", "link", "set", rack.link, "up"])
        for argv in (["ip", "link", "set", "lo", "up"], ["ip", "link", "set", "eth0", "up"]):
            run(rack.inside(argv))
    except BaseException:
        _remove(rack)
        raise
    return rack


def _remove(rack: Rack) -> None:
    """Everything of ``rack``, by the PIDs this module started: its link (both ends), its forwarder, its holder."""
    for proc in (rack.forwarder, rack.holder):
        if proc is None:
            continue
        if proc.poll() is None:
            proc.kill()  # a TUN device ends with its forwarder's descriptor; the holder's namespace with it
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    subprocess.run(["ip", "link", "del", rack.link], capture_output=True, timeout=30)  # a veth pair: both ends


@contextmanager
def racks(delays_us: Sequence[int]) -> Iterator[list[Rack]]:
    """One rack per delay (µs added to what the gateway sends it), removed on exit, whatever happened."""
    made: list[Rack] = []
    try:
        for i, delay in enumerate(delays_us, start=1):
            made.append(_make(f"rack-{i}", i, delay))
        yield made
    finally:
        for rack in made:
            _remove(rack)
