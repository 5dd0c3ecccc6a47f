"""Losing a rack of a Ray cluster under traffic (one machine, loopback-only namespace).

A head node and four servers in two racks (``tests/ray/rack_drill.py``); a two-replica and a one-replica
deployment of the MLP. The two replicas sit on different racks (the default spread rule). A client sends the
two-replica deployment one request after the other through the gateway while every process of both nodes of
the rack that holds the one-replica deployment (raylets, workers, the replicas' actors) is killed with SIGKILL
at once. Checked on the order of what happened, not on time: no request fails — not even within the health
interval before the controller ejects the dead replica, since the gateway retries a request that a replica
did not answer on the other one (``gateway/forward.py``) — the controller fails both nodes over and brings
every deployment back to its count on the surviving rack, and no card is given twice.
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
    domains = {n["name"]: n["domains"] for n in cloud.admin("GET", "/fleet").json()["nodes"]}
    assert {name: d["rack"] for name, d in domains.items()} == drill.RACK_OF  # read back from the Ray labels

    record = drill.Record()
    cloud.cloud.store.subscribe(record.listen)
    traffic = drill.Traffic(cloud, record).start()
    try:
        drill.wait_for("traffic before the kill", drill.oks_after(record, None, 20), timeout=60)
        killed = cluster.kill_nodes(list(lost))
        record.add("kill", " ".join(map(str, killed)))
        drill.wait_for("every deployment back at its count", lambda: drill.at_count(cloud, avoid=lost), 120)
        record.add("back")
        drill.wait_for("traffic after the re-placement", drill.oks_after(record, "back", 20), timeout=60)
    finally:
        traffic.stop()

    entries = record.snapshot()
    print("\n".join(f"{e.at:.3f} {e.what} {e.detail}" for e in entries if e.what != "ok"))  # shown with -s
    kill = next(i for i, e in enumerate(entries) if e.what == "kill")
    assert len(killed) >= 2 * 2, killed  # at least each node's raylet and the actor of a replica
    events = [(i, e.detail) for i, e in enumerate(entries) if e.what == "event"]
    ejected = next(i for i, d in events if d.startswith((f"failover {dead} ", f"failed {dead} ")))
    assert ejected > kill
    for node in lost:
        assert any(d == f"node {node} failed" and i > kill for i, d in events), (node, events)
    first_ok = next(i for i in range(kill, len(entries)) if entries[i].what == "ok")
    failures = [e.detail for e in entries if e.what == "failed"]
    # the gateway retried every request the dead replica did not answer on the surviving one: none failed,
    # neither before the controller ejected it nor after
    assert failures == [], failures[:5]
    assert first_ok < len(entries) and sum(e.what == "ok" for e in entries[kill:]) >= 20

    for name, count in drill.COUNTS.items():
        ready = cloud.ready(name)
        assert len(ready) == count and all(drill.RACK_OF[r["node"]] == kept for r in ready), (name, ready)
    assert len({r["node"] for r in cloud.ready(drill.PAIR)}) == 2  # still on two nodes of the surviving rack
    assert drill.cards_given_twice(cloud) == []
    held = {a.placement.node for a in cloud.cloud.state.allocations.values()}
    assert held.isdisjoint(lost), held
