"""The pieces gateway workers share state with: route snapshots, counter deltas, split rate limits, and the feed
between the main process and its workers over a real Unix socket (no cloud, no replica)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from octacloud.core.clock import ManualClock
from octacloud.gateway.feed import FeedClient, FeedHub
from octacloud.gateway.routing import DeploymentCounters, Endpoint, Owner, RouteTable
from octacloud.gateway.sharing import (
    CounterMerger,
    CounterTracker,
    DemandShares,
    SharedRateLimiter,
    ShareError,
    apply_snapshot,
    route_snapshot,
)
from octacloud.tenancy.keys import Quota

SECRET = "s" * 43


def main_table() -> RouteTable:
    t = RouteTable()
    t.update("a", [Endpoint("r1", "127.0.0.1", 9001, 9002), Endpoint("r2", "127.0.0.1", 9003, 9004)])
    t.update("starting", [])
    t.owners.update({"a": Owner("acme"), "starting": Owner("globex", published=True)})
    t.inflight_per_replica["a"] = 16
    return t


def test_snapshot_round_trip_keeps_live_endpoint_state() -> None:
    main, worker = main_table(), RouteTable()
    apply_snapshot(worker, json.loads(json.dumps(route_snapshot(main))))
    assert route_snapshot(worker) == route_snapshot(main)
    r1 = worker.routes["a"][0]
    r1.outstanding = 2  # the worker's own live state and ejection
    for _ in range(3):
        worker.failed(r1)
    dropped: list[str] = []
    worker.on_drop.append(lambda e: dropped.append(e.replica_id))
    main.drop_endpoint("r2")
    main.remove("starting")
    apply_snapshot(worker, route_snapshot(main))
    assert worker.routes == {"a": [r1]} and (r1.outstanding, r1.failures) == (2, 3)
    assert dropped == ["r2"] and set(worker.owners) == {"a"}
    worker.readmit("r1")
    assert r1.failures == 0


def test_a_replica_found_dead_is_gone_in_each_worker_too() -> None:
    """The main table's ``gone`` reaches a worker with the next snapshot: the worker drops the endpoint and reports
    it gone (its REST front ends what it has in flight there), once; an older snapshot without ``gone`` applies."""
    main, worker = main_table(), RouteTable()
    apply_snapshot(worker, route_snapshot(main))
    seen: list[str] = []
    worker.on_drop.append(lambda e: seen.append(f"drop {e.replica_id}"))
    worker.on_gone.append(lambda e: seen.append(f"gone {e.replica_id}"))
    main.drop_endpoint("r1", gone=True)
    main.drop_endpoint("r2")
    snapshot = json.loads(json.dumps(route_snapshot(main)))
    assert snapshot["gone"] == ["r1"]
    apply_snapshot(worker, snapshot)
    apply_snapshot(worker, snapshot)  # the same news twice: reported once
    assert seen == ["drop r1", "gone r1", "drop r2"] and worker.routes["a"] == []
    older = {k: v for k, v in route_snapshot(main_table()).items() if k != "gone"}
    apply_snapshot(worker, older)
    assert [e.replica_id for e in worker.routes["a"]] == ["r1", "r2"]


@pytest.mark.parametrize(
    "snapshot",
    [
        {},
        {"routes": [], "owners": {}, "inflight": {}},
        {"routes": {"a": [["r1", "h", -1, 2]]}, "owners": {}, "inflight": {}},
        {"routes": {"a": [["r1", "h", 1]]}, "owners": {}, "inflight": {}},
        {"routes": {}, "owners": {"a": ["acme", "yes"]}, "inflight": {}},
        {"routes": {}, "owners": {}, "inflight": {"a": True}},
        {"routes": {}, "owners": {}, "inflight": {}, "gone": "r1"},
        {"routes": {}, "owners": {}, "inflight": {}, "gone": [1]},
    ],
)
def test_malformed_snapshot_changes_nothing(snapshot: dict[str, object]) -> None:
    worker = main_table()
    before = route_snapshot(worker)
    with pytest.raises(ShareError):
        apply_snapshot(worker, snapshot)
    assert route_snapshot(worker) == before


def test_counter_deltas_add_up_once_and_in_flight_leaves_with_its_worker() -> None:
    main = RouteTable()
    merger = CounterMerger(main)
    workers = [RouteTable(), RouteTable()]
    trackers = [CounterTracker(w) for w in workers]
    for n, w in enumerate(workers, start=1):
        c = w.counter("a")
        c.requests, c.bytes_in, c.latency_us_total, c.outstanding = 10 * n, 100 * n, 1000 * n, n
        w.tenant_traffic("acme", "a").requests = 10 * n
    for key, tracker in enumerate(trackers):
        delta = tracker.take()
        assert delta is not None
        merger.add(key, json.loads(json.dumps(delta)))
    assert all(t.take() is None for t in trackers)  # nothing new: nothing pushed, nothing added twice
    c = main.counter("a")
    assert (c.requests, c.bytes_in, c.latency_us_total, c.outstanding) == (30, 300, 3000, 3)
    assert main.traffic[("acme", "a")].requests == 30 and merger.served == {0: 10, 1: 20}
    workers[0].counter("a").requests += 5
    workers[0].counter("a").outstanding = 0
    merger.add(0, trackers[0].take() or {})
    assert (c.requests, c.outstanding) == (35, 2)
    merger.gone(1)  # worker 1 was killed: its 2 requests in flight are no longer in flight; what it pushed stays
    assert (c.requests, c.outstanding, main.traffic[("acme", "a")].requests) == (35, 0, 30)


B = [1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "delta",
    [
        {"deployments": {"b": B, "a": [1, 2, 3]}, "outstanding": {}, "traffic": []},
        {"deployments": {"b": B, "a": [-1, 0, 0, 0, 0, 0]}, "outstanding": {}, "traffic": []},
        {"deployments": {"b": B}, "outstanding": {"a": -1}, "traffic": []},
        {"deployments": {"b": B}, "outstanding": {}, "traffic": [["acme", "a", 1, 2]]},
        {"deployments": {"b": B}, "outstanding": {}, "traffic": [["acme", 7, 1, 2, 3]]},
        {"deployments": {"b": B}, "outstanding": {}},
    ],
)
def test_malformed_delta_adds_nothing(delta: dict[str, object]) -> None:
    main = RouteTable()
    with pytest.raises(ShareError):
        CounterMerger(main).add(0, delta)
    assert main.counters == {} and main.traffic == {}


def test_split_rate_limit_never_admits_more_than_the_tenant_rate() -> None:
    clock = ManualClock()
    quota = Quota(requests_per_s=10.0, burst=5)
    limiters = [SharedRateLimiter(clock, 4) for _ in range(4)]
    admitted = 0
    for step in range(100):  # 10 s, every worker asked 10 times per 0.1 s
        for limiter in limiters:
            admitted += sum(limiter.check("acme", quota) == 0 for _ in range(10))
        clock.advance(0.1)
        assert admitted <= 10.0 * (step + 1) * 0.1 + 4 * math.ceil(5 / 4)
    assert admitted >= 10.0 * 9.9  # and the whole rate is usable when traffic is spread
    one = SharedRateLimiter(clock, 4)  # until the main process rebalances, one worker holds a quarter of the rate
    got = 0
    for _ in range(100):
        got += sum(one.check("acme", quota) == 0 for _ in range(10))
        clock.advance(0.1)
    assert 25 <= got <= 25 + 2
    assert SharedRateLimiter(clock, 2).check("acme", Quota()) == 0
    with pytest.raises(ValueError, match="at least 1"):
        SharedRateLimiter(clock, 0)


QUOTA = Quota(requests_per_s=100.0, burst=20)


def test_rate_shares_follow_demand_and_never_sum_past_the_rate() -> None:
    """Four workers and the main process's rebalance every 0.25 s, on a manual clock. A tenant sends twice its rate,
    first all to worker 0, then all to worker 2, then spread evenly: it gets about its whole rate in each phase,
    never more than its rate (plus the bursts), and the fractions held never sum past 1 even when the workers apply
    a rebalance at different times (here: the odd workers one rebalance late)."""
    clock = ManualClock()
    limiters = [SharedRateLimiter(clock, 4) for _ in range(4)]
    shares = DemandShares(4)
    late: list[dict[str, float]] = [{} for _ in range(4)]
    admitted = 0
    per_phase: list[int] = []
    for phase in ([0], [2], [0, 1, 2, 3]):
        got = 0
        for _step in range(40):  # 10 s of 0.25 s
            for tick in range(25):  # 200 requests/s, every 10 ms
                worker = phase[tick % len(phase)]
                for _ in range(2):
                    got += limiters[worker].check("acme", QUOTA) == 0
                clock.advance(0.01)
            for w, limiter in enumerate(limiters):
                shares.add(w, limiter.take_demand())
            held = shares.rebalance()
            for w, limiter in enumerate(limiters):
                if w % 2:  # applies the previous rebalance now, this one at the next
                    limiter.set_fractions(late[w])
                    late[w] = held[w]
                else:
                    limiter.set_fractions(held[w])
            fractions = [lim.fractions.get("acme", 0.25) for lim in limiters]
            assert sum(fractions) <= 1 + 1e-9, fractions
            assert admitted + got <= 100.0 * clock.monotonic() + 20 + 3, (admitted + got, clock.monotonic())
        admitted += got
        per_phase.append(got)
    # 10 s at 100/s each: the first second of a move runs on the old fractions
    assert all(got >= 850 for got in per_phase), per_phase
    for _ in range(10):  # quiet: back to the even split
        for w, limiter in enumerate(limiters):
            shares.add(w, limiter.take_demand())
        shares.rebalance()
    assert shares.held == [{}, {}, {}, {}]


def test_a_gone_worker_passes_its_fraction_to_the_others() -> None:
    shares = DemandShares(2)
    shares.add(0, {"acme": 100})
    shares.add(1, {"acme": 100})
    for _ in range(2):
        shares.rebalance()
    assert shares.held == [{}, {}]  # even demand: the even split
    shares.gone(1)
    for _ in range(2):
        shares.add(0, {"acme": 100})
        held = shares.rebalance()
    assert held[0]["acme"] == pytest.approx(0.95) and held[1]["acme"] == pytest.approx(0.05)


def test_a_resized_bucket_keeps_its_tokens() -> None:
    """A new fraction does not refill the bucket: a worker told to hold more cannot admit a fresh burst with it."""
    clock = ManualClock()
    limiter = SharedRateLimiter(clock, 4)
    assert sum(limiter.check("acme", QUOTA) == 0 for _ in range(10)) == 5  # burst 20 / 4
    limiter.set_fractions({"acme": 0.9})
    assert limiter.check("acme", QUOTA) > 0  # no token left: no new burst of 18
    clock.advance(0.1)  # 90/s for 0.1 s
    assert sum(limiter.check("acme", QUOTA) == 0 for _ in range(20)) == 9
    # where a slow tenant holds a small fraction, Retry-After is by its whole rate: 0.5/s, retry in 2 s, not 80 s
    limiter.set_fractions({"slow": 0.025})
    slow = Quota(requests_per_s=0.5, burst=1)
    assert limiter.check("slow", slow) == 0 and limiter.check("slow", slow) == 2


@pytest.mark.parametrize("fractions", [[], {"acme": 0}, {"acme": 1.5}, {"acme": True}, {"acme": "0.5"}, {"acme": -1}])
def test_malformed_fractions_change_nothing(fractions: object) -> None:
    limiter = SharedRateLimiter(ManualClock(), 4)
    limiter.set_fractions({"acme": 0.5})
    with pytest.raises(ShareError):
        limiter.set_fractions(fractions)
    assert limiter.fractions == {"acme": 0.5}


@pytest.mark.parametrize(("worker", "demand"), [(2, {"acme": 1}), (-1, {"acme": 1}), (0, []), (0, {"a": 1, "b": -1})])
def test_malformed_demand_adds_nothing(worker: int, demand: object) -> None:
    shares = DemandShares(2)
    with pytest.raises(ShareError):
        shares.add(worker, demand)
    assert shares.rebalance() == [{}, {}]


def test_a_worker_counts_what_the_others_have_in_flight_against_the_bound() -> None:
    """The main process tells each worker what the others have in flight (as they pushed it); a worker admits only
    while its own and theirs stay under the deployment's bound, and may use all of it while they use none."""
    main = main_table()  # "a": two replicas, 16 in flight per replica
    merger = CounterMerger(main)
    merger.add(1, {"deployments": {}, "outstanding": {"a": 20}, "traffic": []})
    merger.add(2, {"deployments": {}, "outstanding": {"a": 10, "starting": 0}, "traffic": []})
    assert merger.elsewhere(1) == {"a": 10} and merger.elsewhere(2) == {"a": 20} and merger.elsewhere(3) == {"a": 30}
    worker = main_table()
    worker.inflight_elsewhere = merger.elsewhere(2)
    worker.counter("a").outstanding = 11
    assert worker.admit("a", None, 8) is worker.counter("a")  # 11 + 20 < 32
    worker.counter("a").outstanding = 12
    refused = worker.admit("a", None, 8)
    assert not isinstance(refused, DeploymentCounters) and refused.why == "at capacity"
    merger.gone(1)  # the busy worker went away: its requests no longer count anywhere
    worker.inflight_elsewhere = merger.elsewhere(2)
    assert worker.inflight_elsewhere == {} and worker.admit("a", None, 8) is worker.counter("a")


async def test_feed_tells_each_worker_what_the_others_have_in_flight(tmp_path: Path) -> None:
    hub = FeedHub(main_table(), SECRET, tmp_path / "feed.sock", lambda: True, workers=2, poll_s=0.01)
    await hub.start()
    tables = [RouteTable(), RouteTable()]
    clients = [
        FeedClient(hub.path, SECRET, i, t, lambda k, t: None, SharedRateLimiter(ManualClock(), 2), push_s=0.01)
        for i, t in enumerate(tables)
    ]
    try:
        for client in clients:
            await client.connect()
        running = [asyncio.create_task(client.run()) for client in clients]
        tables[0].counter("a").outstanding = 5
        await _until(lambda: tables[1].inflight_elsewhere == {"a": 5})
        assert tables[0].inflight_elsewhere == {}
        await clients[0].close()  # the worker went away with what it had in flight
        await _until(lambda: tables[1].inflight_elsewhere == {})
        await clients[1].close()
        await asyncio.wait_for(asyncio.gather(*running), 5)
    finally:
        for client in clients:
            await client.close()
        await hub.stop()


async def _until(predicate: object, timeout: float = 5.0) -> None:
    assert callable(predicate)
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_feed_pushes_routes_readmits_forgets_and_merges(tmp_path: Path) -> None:
    main = main_table()
    ready = [True]
    hub = FeedHub(
        main,
        SECRET,
        tmp_path / "feed.sock",
        lambda: ready[0],
        workers=4,
        poll_s=0.01,
        heartbeat_s=0.05,
        rebalance_s=0.01,
    )
    await hub.start()
    forgotten: list[tuple[str | None, str | None]] = []
    worker = RouteTable()
    limiter = SharedRateLimiter(ManualClock(), 4)
    client = FeedClient(hub.path, SECRET, 3, worker, lambda k, t: forgotten.append((k, t)), limiter, push_s=0.01)
    try:
        await client.connect()
        assert route_snapshot(worker) == route_snapshot(main)  # before it serves anything
        running = asyncio.create_task(client.run())
        await _until(client.ready)
        client.serving(8000, 8001)
        await _until(lambda: hub.serving() == {3: (8000, 8001)})

        main.update("b", [Endpoint("r3", "127.0.0.1", 9005, 9006)])  # the controller changed the table
        main.owners["b"] = Owner("acme")
        await _until(lambda: "b" in worker.routes and "b" in worker.owners)
        ejected = worker.routes["b"][0]
        for _ in range(3):
            worker.failed(ejected)  # the worker ejects it and tells the hub
        await _until(lambda: hub.ejected == {"r3"})
        hub.readmit("r3")
        await _until(lambda: ejected.failures == 0)
        assert not hub.ejected
        hub.forget("k1", None)
        await _until(lambda: forgotten == [("k1", None)])

        # acme's requests all reach this worker (each poll below is one): the hub gives it most of acme's rate,
        # then the even split back once acme goes quiet
        quota = Quota(requests_per_s=100.0, burst=10)
        await _until(lambda: limiter.check("acme", quota) >= 0 and limiter.fractions.get("acme", 0) > 0.9)
        assert all(hub.rates.held[w]["acme"] < 0.03 for w in range(3))
        await _until(lambda: "acme" not in limiter.fractions)

        worker.counter("b").requests = 7
        worker.tenant_traffic("acme", "b").requests = 7
        worker.counter("b").outstanding = 2
        await _until(lambda: main.traffic.get(("acme", "b")) is not None and main.counter("b").outstanding == 2)
        assert main.traffic[("acme", "b")].requests == 7 and hub.served() == {3: 7}

        ready[0] = False
        await _until(lambda: not client.ready())
        await client.close()  # the worker went away: its requests in flight leave with it
        await asyncio.wait_for(running, 5)
        await _until(lambda: main.counter("b").outstanding == 0 and not hub.workers)
        assert main.counter("b").requests == 7
    finally:
        await client.close()
        await hub.stop()


async def test_feed_refuses_a_client_without_the_secret(tmp_path: Path) -> None:
    hub = FeedHub(RouteTable(), SECRET, tmp_path / "feed.sock", lambda: True)
    await hub.start()
    try:
        stranger = FeedClient(
            hub.path, "wrong", 0, RouteTable(), lambda k, t: None, SharedRateLimiter(ManualClock(), 1)
        )
        with pytest.raises(ShareError, match="internal secret"):
            await stranger.connect()
        await stranger.close()
        reader, writer = await asyncio.open_unix_connection(str(hub.path))
        writer.write(b"x" * 100 + b"\n")
        assert b"refused" in await reader.readline()
        writer.close()
        unknown = FeedClient(hub.path, SECRET, 1, RouteTable(), lambda k, t: None, SharedRateLimiter(ManualClock(), 2))
        with pytest.raises(ShareError, match="worker index 1 is not one of 0..0"):
            await unknown.connect()
        await unknown.close()
        assert hub.refused == 3 and not hub.workers
    finally:
        await hub.stop()


async def test_feed_readmits_only_what_a_worker_ejected(tmp_path: Path) -> None:
    """The controller reports every probe that passes; the hub sends a readmission only for a replica some worker
    said it ejected, once, and forgets ejections of replicas no longer routed. A second worker hears the
    readmission too; an ``ejected`` that is not a replica id cuts its worker off, and the other keeps its feed."""
    main = main_table()
    hub = FeedHub(main, SECRET, tmp_path / "feed.sock", lambda: True, workers=2, poll_s=0.01)
    sent: list[dict[str, Any]] = []
    broadcast = hub.broadcast

    def recorded(message: dict[str, Any]) -> None:
        sent.append(message)
        broadcast(message)

    hub.broadcast = recorded  # type: ignore[method-assign]
    await hub.start()
    tables = [RouteTable(), RouteTable()]
    clients = [
        FeedClient(hub.path, SECRET, i, tables[i], lambda k, t: None, SharedRateLimiter(ManualClock(), 2), push_s=0.01)
        for i in range(2)
    ]
    try:
        for c in clients:
            await c.connect()
        running = [asyncio.create_task(c.run()) for c in clients]
        hub.readmit("r1")  # ready, and ejected nowhere: nothing to say
        hub.readmit("nobody")
        assert not [m for m in sent if m["t"] == "readmit"]
        told: list[str] = []
        main.on_eject.append(lambda e: told.append(e.replica_id))  # the controller's probe-soon, in the cloud
        r1, other = tables[0].routes["a"][0], tables[1].routes["a"][0]
        for _ in range(3):
            tables[0].failed(r1)
        other.failures = 2  # failing at the other worker, not ejected: a readmission leaves its count
        await _until(lambda: hub.ejected == {"r1"})
        assert told == ["r1"]
        hub.readmit("r1")
        hub.readmit("r1")  # the next probe: already readmitted
        await _until(lambda: r1.failures == 0)
        assert [m for m in sent if m["t"] == "readmit"] == [{"t": "readmit", "replica": "r1"}]
        assert other.failures == 2 and not hub.ejected
        for _ in range(3):
            tables[1].failed(tables[1].routes["a"][1])
        await _until(lambda: hub.ejected == {"r2"})
        main.drop_endpoint("r2")  # no longer routed: its ejection is forgotten
        await _until(lambda: not hub.ejected)
        clients[1]._send({"t": "ejected", "replica": 7})
        with pytest.raises(ShareError, match="ejected needs a replica id"):
            await asyncio.wait_for(running[1], 5)
        assert len(hub.workers) == 1 and tables[0].routes["a"] == [r1]
    finally:
        for c in clients:
            await c.close()
        await hub.stop()
