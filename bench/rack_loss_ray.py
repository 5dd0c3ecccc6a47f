"""Losing a rack of a live Ray cluster under traffic: how long until requests succeed again, the dead replica is
taken out and every deployment is back at its count.

    scripts/netns-run .venv/bin/python bench/rack_loss_ray.py [--runs 1] [--no-record]

The scenario of ``tests/ray/test_rack_loss.py`` (``tests/ray/rack_drill.py``): a head node and four servers in
two racks of two on this machine, one CPU "card" each; the MLP (``$OCTACLOUD_MODELS/mlp``) as a deployment of
two replicas (one per rack, the default spread rule) and one of one; the controller's default settings, as
``octacloud up --backend ray`` runs it. One client per deployment sends it one request after the other through
the gateway; every process of the rack holding the one-replica deployment is killed with SIGKILL at once.
Printed per run, in seconds from the kill: the two-replica deployment's first answer after it, the
controller's first event that takes its dead replica out (its process seen gone or its probes failed, or its
node seen lost), both nodes seen lost, the replacements placed, every deployment back at its count on the
other rack, and the one-replica deployment answering again; and the requests that failed of all sent, per
deployment. Appends the runs to ``bench/results/rack_loss_ray.jsonl``. Run it inside the loopback-only
namespace: there Ray binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# `import ray` must find Ray, not bench/ray.py: this folder goes last on the import path (for record.py)
sys.path[:] = [str(ROOT / "src"), str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.append(str(ROOT / "bench"))

from tests.ray import rack_drill as drill  # noqa: E402
from tests.ray.harness import CloudThread, ray_cloud  # noqa: E402

from octacloud.app import CloudConfig  # noqa: E402
from octacloud.control.controller import ControllerSettings  # noqa: E402
from octacloud.control.ray.local import LocalRayCluster  # noqa: E402
from record import Recorder, add_flag  # noqa: E402


def run_once(work: Path, models: Path, settings: ControllerSettings) -> dict[str, Any]:
    temp = Path(f"/tmp/octacloud-rack-bench-{os.getpid()}")  # Ray's socket paths must stay short
    config = CloudConfig(repository=drill.model_repository(work, models), state_dir=work / "var", http_port=0,
                         grpc_port=0, controller=settings)  # fmt: skip
    with LocalRayCluster(drill.rack_nodes(), temp_dir=temp, bare_head=True) as cluster:
        cloud = CloudThread(lambda: ray_cloud(config, cache_root=work / "node-cache"))
        try:
            drill.deploy(cloud)
            placed = {name: sorted(r["node"] for r in cloud.ready(name)) for name in drill.COUNTS}
            rack = drill.RACK_OF[placed[drill.SINGLE][0]]
            lost = drill.RACKS[rack]
            dead = next(r["id"] for r in cloud.ready(drill.PAIR) if r["node"] in lost)
            record = drill.Record()
            cloud.cloud.store.subscribe(record.listen)
            traffic = [drill.Traffic(cloud, record, name).start() for name in drill.COUNTS]
            try:
                for name in drill.COUNTS:
                    drill.wait_for(f"{name} before the kill", drill.oks_after(record, None, 50, name), timeout=60)
                record.add("kill", " ".join(map(str, cluster.kill_nodes(list(lost)))))
                drill.wait_for("every deployment back at its count", lambda: drill.at_count(cloud, lost), 300)
                record.add("back")
                for name in drill.COUNTS:
                    drill.wait_for(f"{name} after the kill", drill.oks_after(record, "back", 50, name), timeout=60)
            finally:
                for client in traffic:
                    client.stop()
            left = drill.cards_given_twice(cloud)
        finally:
            cloud.stop(stop_replicas=True)
    shutil.rmtree(temp, ignore_errors=True)
    return {"placed": placed, "rack_lost": rack, "dead_replica": dead, "cards_given_twice": left,
            **figures(record.snapshot(), dead, lost)}  # fmt: skip


def figures(entries: list[drill.Entry], dead: str, lost: tuple[str, ...]) -> dict[str, Any]:
    """Seconds from the kill to each milestone, and the requests' outcomes around it."""
    kill = next(i for i, e in enumerate(entries) if e.what == "kill")
    t0 = entries[kill].at
    after = entries[kill:]

    def first(match: Any) -> float | None:
        return next((round(e.at - t0, 3) for e in after if match(e)), None)

    events = [e for e in after if e.what == "event"]
    taken_out = (f"failed {dead} ", f"failover {dead} ")
    nodes_lost = [first(lambda e, n=n: e.what == "event" and e.detail == f"node {n} failed") for n in lost]
    last_failed = max(
        (i for i, e in enumerate(after) if e.what == "failed" and e.deployment == drill.SINGLE), default=0
    )
    answered = next((e for e in after[last_failed:] if e.what == "ok" and e.deployment == drill.SINGLE), None)
    return {
        "first_ok_s": first(lambda e: e.what == "ok" and e.deployment == drill.PAIR),
        "ejected_s": first(lambda e: e.what == "event" and e.detail.startswith(taken_out)),
        "nodes_lost_s": max((t for t in nodes_lost if t is not None), default=None),
        "replaced_placed_s": first(lambda e: e.what == "event" and e.detail.startswith("placed ")),
        "back_at_count_s": first(lambda e: e.what == "back"),
        "single_answers_again_s": None if answered is None else round(answered.at - t0, 3),
        **{f"{name}_{key}": value for name in drill.COUNTS for key, value in outcomes(entries, name).items()},
        "events": [f"{e.at - t0:+.3f} {e.detail}" for e in events],
    }


def outcomes(entries: list[drill.Entry], deployment: str) -> dict[str, Any]:
    """Requests to ``deployment``: all, failed, and the first few failures' answers."""
    mine = [e for e in entries if e.deployment == deployment]
    failed = [e.detail for e in mine if e.what == "failed"]
    return {"requests": len(mine), "failed": len(failed), "failures": failed[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    add_flag(parser)
    args = parser.parse_args()
    models = Path(os.environ.get("OCTACLOUD_MODELS", ROOT / "models"))
    if not (models / drill.MODEL / "config.pbtxt").is_file():
        raise SystemExit(f"no MLP at {models / drill.MODEL}: run `make models` or set OCTACLOUD_MODELS")
    recorder = Recorder("rack_loss_ray")
    settings = ControllerSettings()
    runs = []
    for _ in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="octacloud-bench-rack-"))
        try:
            runs.append(run_once(work, models, settings))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"controller: health every {settings.health_interval_s:g} s, {settings.probe_failures_to_fail} probes "
          f"to fail, pass every {settings.interval_s:g} s; Ray: a node seen lost after ~1.3 s")  # fmt: skip
    print(f"{'run':>3} {'rack':>4} {'first ok':>8} {'ejected':>8} {'nodes lost':>10} {'placed':>7} "
          f"{'back':>6} {'single ok':>9} {'pair failed':>12} {'single failed':>13} {'twice':>5}")  # fmt: skip
    for i, r in enumerate(runs, 1):
        print(f"{i:>3} {r['rack_lost']:>4} {_s(r['first_ok_s']):>8} {_s(r['ejected_s']):>8} "
              f"{_s(r['nodes_lost_s']):>10} {_s(r['replaced_placed_s']):>7} {_s(r['back_at_count_s']):>6} "
              f"{_s(r['single_answers_again_s']):>9} {r['pair_failed']:>5}/{r['pair_requests']:<6} "
              f"{r['single_failed']:>6}/{r['single_requests']:<6} {len(r['cards_given_twice']):>5}")  # fmt: skip
    for r in runs:
        print("\n".join(r["events"]))
    recorder.save({"settings": {"health_interval_s": settings.health_interval_s, "interval_s": settings.interval_s,
                                "probe_failures_to_fail": settings.probe_failures_to_fail}, "runs": runs})  # fmt: skip


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
