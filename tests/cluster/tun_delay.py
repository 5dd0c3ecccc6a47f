"""A delayed point-to-point link for kernels without ``tc netem``: two TUN devices, one in this process's network
namespace (``GATEWAY_END``), one in a rack's (``eth0``), and this process between them holding every packet
towards the rack for the delay (packets back pass at once), as netem's ``delay`` on the gateway's end would.

``python -m tests.cluster.tun_delay GATEWAY_END RACK_PID DELAY_US`` prints ``ready`` once both devices exist
(the caller gives them addresses and brings them up) and forwards until it is killed.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def enter_namespace(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    ns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(ns)


def send(fd: int, packet: bytes) -> None:
    try:
        os.write(fd, packet)
    except OSError:  # the device is not up (yet): the packet is lost, as on a link that is down
        pass


def forward(gateway: int, rack: int, delay_s: float) -> None:
    held: list[tuple[float, int, bytes]] = []
    seq = 0
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            send(rack, heapq.heappop(held)[2])
        timeout = max(0.0, held[0][0] - now) if held else None
        ready, _, _ = select.select([gateway, rack], [], [], timeout)
        for fd in ready:
            try:
                packet = os.read(fd, 65536)
            except OSError:  # a device was removed: the link is gone, and so is this forwarder's work
                return
            if fd == gateway:
                seq += 1
                heapq.heappush(held, (time.monotonic() + delay_s, seq, packet))
            else:
                send(gateway, packet)


def main(gateway_end: str, rack_pid: int, delay_us: int) -> None:
    gateway = open_tun(gateway_end)
    enter_namespace(rack_pid)
    rack = open_tun("eth0")
    print("ready", flush=True)
    forward(gateway, rack, delay_us / 1e6)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
