"""How long a waiting replica waits once the slice it needs is released, against the controller's reconcile interval.

    .venv/bin/python bench/release_wake.py [--rounds 5] [--interval 5]

Starts a cloud in this process (as ``octacloud up`` runs it: gateway and controller on one event loop, replicas
as local processes) on a declared one-node fleet with one CPU card, the product's default policy (with its 20 %
failover reserve) and the reconcile interval ``--interval`` (the product's default, 5 s). Each round deploys
``a`` (4 octants) and waits until it is ready, deploys ``b`` (4 octants, which fits nowhere beside ``a``), undeploys
``a`` and records, from the scheduler's state, when ``a``'s replica stops holding its slice (drained and stopped in
the background by the reconcile the DELETE wakes) and when ``b`` holds one. Prints each round and the mean and worst
time from the release to ``b``'s placement, next to the interval: a controller that looks at its queue only on its
ticks leaves ``b`` waiting for the rest of the interval the DELETE's reconcile began; one woken by the release
places it at once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from octacloud.control.controller import ControllerSettings
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from record import Recorder, add_flag
from scale_down import CloudThread


def placed(c: CloudThread, name: str) -> list[dict[str, Any]]:
    return [r for r in c.admin("GET", f"/deployments/{name}")["instances"] if r["gpus"]]


def release_and_placement(c: CloudThread, gone: str, comes: str, timeout: float = 120.0) -> tuple[float, float]:
    """Poll the scheduler's state every millisecond: when replica ``gone`` stops holding its slice and when
    replica ``comes`` holds one (monotonic times)."""
    allocations = c.cloud.state.allocations
    released = 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.monotonic()
        if not released and gone not in allocations:
            released = now
        if comes in allocations:
            return released or now, now
        time.sleep(0.001)
    raise SystemExit(f"timed out waiting for {comes} to be placed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=5.0, help="the controller's reconcile interval, seconds")
    add_flag(ap)
    args = ap.parse_args()
    recorder = Recorder("release_wake")
    nodes = [Node("bench", 8_000, 65_536, (Gpu(0, CPU_CARD_MODEL, 4096),))]
    settings = ControllerSettings(interval_s=args.interval, stop_grace_s=3.0, drain_timeout_s=2.0)
    c = CloudThread.in_temp("octacloud-release-wake-", nodes, settings)
    waits: list[float] = []
    try:
        for k in range(args.rounds):
            a, b = f"a{k}", f"b{k}"
            c.admin("POST", "/deployments", {"name": a, "model": "small", "octants": 4})
            c.wait(f"{a} ready", lambda a=a: c.ready(a) == 1)  # type: ignore[misc]
            (a_id,) = [r["id"] for r in placed(c, a)]
            c.admin("POST", "/deployments", {"name": b, "model": "small", "octants": 4})
            time.sleep(1.0)
            if placed(c, b):
                raise SystemExit(f"{b} was placed beside {a}: the fleet has room for both, nothing to measure")
            (b_id,) = [r["id"] for r in c.admin("GET", f"/deployments/{b}")["instances"]]
            t0 = time.monotonic()
            c.admin("DELETE", f"/deployments/{a}")
            t1, t2 = release_and_placement(c, a_id, b_id)
            waits.append(t2 - t1)
            print(f"round {k}: {a}'s slice released {t1 - t0:.3f} s after its DELETE; {b} placed {t2 - t1:.3f} s later")
            c.admin("DELETE", f"/deployments/{b}")
            c.wait(f"{b} gone", lambda: c.cloud.state.allocated_gpu_milli == 0)
    finally:
        c.close()
    worst = max(waits)
    print(
        f"from the release to the waiting replica's placement: mean {statistics.mean(waits):.3f} s, worst "
        f"{worst:.3f} s; the reconcile interval {args.interval:g} s (worst ÷ interval {worst / args.interval:.4f})"
    )
    recorder.save({"waits_s": waits, "interval_s": args.interval})


if __name__ == "__main__":
    main()
