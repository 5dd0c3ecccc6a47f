"""Losing a rack of a Ray cluster under traffic (one machine, loopback-only namespace).

A head node and four servers in two racks (``tests/ray/rack_drill.py``); a two-replica and a one-replica
deployment of the MLP. The two replicas sit on different racks (the default spread rule). A client per
deployment sends it one request after the other through the gateway while every process of both nodes of the
rack that holds the one-replica deployment (raylets, workers, the replicas' actors) is killed with SIGKILL at
once. Checked on the order of what happened, not on time: no request of the two-replica deployment fails — not
even within the health interval before the controller ejects the dead replica, since the gateway retries a
request that a replica did not answer on the other one (``gateway/forward.py``); the one-replica deployment's
requests fail with a clear 503 until its re-placement serves, and none after; the controller fails both nodes
over and brings every deployment back to its count on the surviving rack, and no card is given twice.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from octacloud.control.ray.local import LocalRayCluster

from . import rack_drill as drill
from .harness import CloudThread, fast_config, ray_cloud

pytestmark = pytest.mark.slow


def models_dir() -> Path:
    return Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))


@pytest.fixture
def racked(tmp_path: Path) -> Iterator[tuple[LocalRayCluster, CloudThread]]:
    if not (models_dir() / drill.MODEL / "config.pbtxt").is_file():
        pytest.skip(f"the example models are not built at {models_dir()}: run `make models` (or set OCTACLOUD_MODELS)")
    temp = Path(f"/tmp/octacloud-rack-{os.getpid()}")  # Ray's socket paths must stay short: not under tmp_path
    cluster = LocalRayCluster(drill.rack_nodes(), temp_dir=temp, bare_head=True)
    cloud = None
    try:
        config = fast_config(tmp_path / "var", drill.model_repository(tmp_path, models_dir()))
        cloud = CloudThread(lambda: ray_cloud(config, cache_root=tmp_path / "node-cache"))
        drill.deploy(cloud)
        yield cluster, cloud
    finally:
        if cloud is not None:
            cloud.stop(stop_replicas=True)
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_losing_a_rack_under_traffic_fails_no_request(racked: tuple[LocalRayCluster, CloudThread]) -> None:
    cluster, cloud = racked
    pair = cloud.ready(drill.PAIR)
    assert {drill.RACK_OF[r["node"]] for r in pair} == {"r1", "r2"}, pair  # the spread rule: one per rack
    rack = drill.RACK_OF[cloud.ready(drill.SINGLE)[0]["node"]]  # the rack that holds the single replica too
    lost, kept = drill.RACKS[rack], next(r for r in drill.RACKS if r != rack)
    dead = next(r["id"] for r in pair if r["node"] in lost)
    single = cloud.ready(drill.SINGLE)[0]["id"]
    domains = {n["name"]: n["domains"] for n in cloud.admin("GET", "/fleet").json()["nodes"]}
    assert {name: d["rack"] for name, d in domains.items()} == drill.RACK_OF  # read back from the Ray labels

    record = drill.Record()
    cloud.cloud.store.subscribe(record.listen)
    traffic = [drill.Traffic(cloud, record, name).start() for name in (drill.PAIR, drill.SINGLE)]
    try:
        for name in drill.COUNTS:
            drill.wait_for(f"traffic to {name} before the kill", drill.oks_after(record, None, 20, name), 60)
        killed = cluster.kill_nodes(list(lost))
        record.add("kill", " ".join(map(str, killed)))
        drill.wait_for("every deployment back at its count", lambda: drill.at_count(cloud, avoid=lost), 120)
        record.add("back")
        for name in drill.COUNTS:
            drill.wait_for(f"traffic to {name} after the re-placement", drill.oks_after(record, "back", 20, name), 60)
    finally:
        for client in traffic:
            client.stop()

    entries = record.snapshot()
    show(entries)
    kill = next(i for i, e in enumerate(entries) if e.what == "kill")
    assert len(killed) >= 2 * 2, killed  # at least each node's raylet and the actor of a replica
    events = [(i, e.detail) for i, e in enumerate(entries) if e.what == "event"]
    ejected = next(i for i, d in events if d.startswith((f"failover {dead} ", f"failed {dead} ")))
    assert ejected > kill
    for node in lost:
        assert any(d == f"node {node} failed" and i > kill for i, d in events), (node, events)
    pair_outcomes = [e for e in entries[kill:] if e.deployment == drill.PAIR]
    failures = [e.detail for e in entries if e.deployment == drill.PAIR and e.what == "failed"]
    # the gateway retried every request the dead replica did not answer on the surviving one: none failed,
    # neither before the controller ejected it nor after
    assert failures == [], failures[:5]
    assert sum(e.what == "ok" for e in pair_outcomes) >= 20

    single_fails_until_it_serves_again(entries, kill, single)

    for name, count in drill.COUNTS.items():
        ready = cloud.ready(name)
        assert len(ready) == count and all(drill.RACK_OF[r["node"]] == kept for r in ready), (name, ready)
    assert len({r["node"] for r in cloud.ready(drill.PAIR)}) == 2  # still on two nodes of the surviving rack
    assert drill.cards_given_twice(cloud) == []
    held = {a.placement.node for a in cloud.cloud.state.allocations.values()}
    assert held.isdisjoint(lost), held


def single_fails_until_it_serves_again(entries: list[drill.Entry], kill: int, single: str) -> None:
    """The single replica has nothing to retry on: its requests fail, with a clear 503 naming the deployment,
    from the kill until its re-placement answers, and none after."""
    outage = [(i, e.detail) for i, e in enumerate(entries) if e.deployment == drill.SINGLE and e.what == "failed"]
    assert outage and all(i > kill for i, _ in outage), outage[:3]
    assert all(d.startswith("503: ") and "single" in d for _, d in outage), outage[:3]
    ready = f"ready {single} "
    serving = next(i for i, e in enumerate(entries) if i > kill and e.what == "event" and e.detail.startswith(ready))
    served = next(
        i for i in range(serving, len(entries)) if entries[i].deployment == drill.SINGLE and entries[i].what == "ok"
    )
    assert all(i < served for i, _ in outage), (served, outage[-3:])


def show(entries: list[drill.Entry]) -> None:
    """What happened besides the requests, and the requests counted (shown with -s)."""
    shown = [f"{e.at:.3f} {e.what} {e.detail}" for e in entries if e.what not in ("ok", "failed")]
    counts = {(e.deployment, e.what) for e in entries if e.deployment}
    shown += [f"{d} {w}: {sum((e.deployment, e.what) == (d, w) for e in entries)}" for d, w in sorted(counts)]
    print("\n" + "\n".join(shown))
