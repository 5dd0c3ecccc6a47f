"""Routing: power of two choices on outstanding requests, skipping failed and excluded replicas."""

from __future__ import annotations

import random

import pytest

from octacloud.gateway.grpc_proxy import model_name
from octacloud.gateway.routing import (
    GONE_MEMORY_S,
    MAX_CONSECUTIVE_FAILURES,
    Endpoint,
    NotAdmitted,
    OutlierPolicy,
    Owner,
    RouteTable,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_prefers_less_loaded_and_skips_failed() -> None:
    table = RouteTable(rng=random.Random(1))
    busy, idle = Endpoint("a", "127.0.0.1", 1, 2, outstanding=5), Endpoint("b", "127.0.0.1", 3, 4)
    table.update("m", [busy, idle])
    assert all(table.choose("m") is idle for _ in range(20))
    assert table.choose("m", exclude=["b"]) is busy
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        table.failed(idle)
    assert table.choose("m") is busy
    assert table.choose("unknown") is None


def test_update_keeps_live_counts_and_drop_stops_routing() -> None:
    table = RouteTable()
    a = Endpoint("a", "127.0.0.1", 1, 2, outstanding=2)
    table.update("m", [a])
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2), Endpoint("b", "127.0.0.1", 3, 4)])
    assert table.routes["m"][0] is a
    table.drop_endpoint("a")
    assert [e.replica_id for e in table.routes["m"]] == ["b"]


def test_model_name_reads_field_one() -> None:
    from tritonclient.grpc import service_pb2

    msg = service_pb2.ModelInferRequest(model_name="resnet", model_version="2", id="x")
    assert model_name(msg.SerializeToString()) == "resnet"
    assert model_name(service_pb2.ModelReadyRequest(name="bert").SerializeToString()) == "bert"
    assert model_name(b"") == ""


def test_model_name_is_the_last_occurrence_as_protobuf_reads_it() -> None:
    """Two model_name fields: protobuf (and so the replica) takes the last; routing on the first would send
    the request to one deployment and have it served as another's."""
    from tritonclient.grpc import service_pb2

    first = service_pb2.ModelInferRequest(model_name="mine", id="a").SerializeToString()
    second = service_pb2.ModelInferRequest(model_name="theirs").SerializeToString()
    wire = first + second  # concatenated messages merge: the last scalar wins
    assert service_pb2.ModelInferRequest.FromString(wire).model_name == "theirs"
    assert model_name(wire) == "theirs"


@pytest.mark.parametrize(
    "wire",
    [
        b"\x0a\x05ab",  # length past the end
        b"\x0a\x02\xff\xfe",  # not UTF-8
        b"\x08\x01",  # field 1 as a varint
        b"\x0b",  # a group start
        b"\x12" + b"\xff" * 11,  # a varint longer than 10 bytes
    ],
)
def test_malformed_messages_are_refused_not_guessed(wire: bytes) -> None:
    with pytest.raises(ValueError, match="."):
        model_name(wire)


def test_ejection_expires_doubles_and_lets_one_trial_in() -> None:
    clock = FakeClock()
    table = RouteTable(outlier=OutlierPolicy(base_ejection_s=1.0, max_ejection_s=8.0), now=clock)
    e = Endpoint("a", "127.0.0.1", 1, 2)
    table.update("m", [e])
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        table.failed(e)
    assert table.choose("m") is None and table.retry_after("m") == 1
    clock.t += 1.01  # the ejection is over: one trial request at a time
    assert table.choose("m") is e
    e.outstanding = 1
    assert table.choose("m") is None
    e.outstanding = 0
    table.failed(e)  # the trial failed: ejected again, twice as long
    clock.t += 1.01
    assert table.choose("m") is None
    clock.t += 1.0
    assert table.choose("m") is e
    table.succeeded(e)
    assert e.failures == 0 and table.choose("m") is e
    for _ in range(10):  # repeated ejections never exceed the maximum
        for _ in range(MAX_CONSECUTIVE_FAILURES):
            table.failed(e)
        clock.t += 8.0
    assert table.choose("m") is e


def test_the_stalled_replica_of_the_issue_comes_back() -> None:
    """The controller's update keeps the same endpoint object: a mark that never expired blackholed it."""
    clock = FakeClock()
    table = RouteTable(now=clock)
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2)])
    [e] = table.routes["m"]
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        table.failed(e)
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2)])  # same replica, same object kept
    assert table.routes["m"][0] is e and table.choose("m") is None
    clock.t += OutlierPolicy().max_ejection_s
    assert table.choose("m") is e


def test_readiness_from_the_controller_ends_an_ejection() -> None:
    clock = FakeClock()
    table = RouteTable(now=clock)
    e = Endpoint("a", "127.0.0.1", 1, 2)
    table.update("m", [e])
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        table.failed(e)
    assert table.choose("m") is None
    table.readmit("a")
    assert table.choose("m") is e


def test_dropped_endpoints_are_reported() -> None:
    table = RouteTable()
    dropped: list[str] = []
    table.on_drop.append(lambda e: dropped.append(e.replica_id))
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2), Endpoint("b", "127.0.0.1", 3, 4)])
    table.update("m", [Endpoint("b", "127.0.0.1", 3, 4)])
    table.drop_endpoint("b")
    assert dropped == ["a", "b"]


def test_a_replica_found_dead_is_reported_gone_after_its_drop_and_one_stopped_on_purpose_is_not() -> None:
    now = [100.0]
    table = RouteTable(now=lambda: now[0])
    seen: list[str] = []
    table.on_drop.append(lambda e: seen.append(f"drop {e.replica_id}"))
    table.on_gone.append(lambda e: seen.append(f"gone {e.replica_id}"))
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2), Endpoint("b", "127.0.0.1", 3, 4)])
    table.drop_endpoint("a")  # drained and stopped: what it has in flight finishes
    table.drop_endpoint("b", gone=True)  # its process died
    assert seen == ["drop a", "drop b", "gone b"] and table.routes == {"m": []}
    assert table.gone == {"b": 100.0}
    now[0] += GONE_MEMORY_S + 1
    table.drop_endpoint("c")
    assert table.gone == {}  # remembered only as long as workers need to hear of it


def test_the_in_flight_bound_scales_with_ready_replicas_and_can_be_set_per_deployment() -> None:
    table = RouteTable()
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2), Endpoint("b", "127.0.0.1", 3, 4)])
    assert table.inflight_bound("m", 16) == 32
    table.inflight_per_replica["m"] = 128
    assert table.inflight_bound("m", 16) == 256
    assert table.inflight_bound("m", 0) == 256 and table.inflight_bound("none", 16) == 0


def test_admit_is_one_decision_for_both_fronts() -> None:
    """Unknown and invisible read the same; a deployment without ready replicas and one at its bound are told
    apart; a refusal at the bound is counted as shed and takes no slot."""
    table = RouteTable()
    table.owners["mine"] = Owner("a")
    table.owners["theirs"] = Owner("b")
    table.update("mine", [Endpoint("r1", "127.0.0.1", 1, 2)])
    table.update("theirs", [Endpoint("r2", "127.0.0.1", 3, 4)])
    table.owners["empty"] = Owner("a")

    def as_a(owner: str, published: bool) -> bool:
        return owner == "a" or published

    unknown, invisible = table.admit("nope", as_a, 2), table.admit("theirs", as_a, 2)
    assert isinstance(unknown, NotAdmitted) and isinstance(invisible, NotAdmitted)
    assert (unknown.why, invisible.why) == ("unknown", "unknown")
    assert invisible.message == "unknown model or deployment 'theirs'"
    assert not isinstance(table.admit("theirs", None, 2), NotAdmitted)  # no keys: everything is visible
    empty = table.admit("empty", as_a, 2)
    assert isinstance(empty, NotAdmitted) and empty.why == "no replica"
    counters = table.admit("mine", as_a, 2)
    assert not isinstance(counters, NotAdmitted) and counters.outstanding == 0  # the caller takes the slot
    counters.outstanding = 2  # one replica × 2 per replica
    full = table.admit("mine", as_a, 2)
    assert isinstance(full, NotAdmitted) and full.why == "at capacity" and "2 requests in flight" in full.message
    assert counters.shed == 1 and counters.outstanding == 2
    assert not isinstance(table.admit("mine", as_a, 0), NotAdmitted)  # 0: no bound


async def test_an_answer_is_billed_before_it_leaves_the_gateway() -> None:
    """The meter may close an interval the moment a client holds its answer: the request is in it already."""
    from octacloud.gateway.rest import RestGateway
    from octacloud.gateway.upstream import Response

    class Pool:
        def forget(self, host: str, port: int) -> None: ...

        async def request(self, *args: object, **kwargs: object) -> Response:
            return Response(200, [(b"content-type", b"application/json")], b'{"outputs": []}')

    table = RouteTable()
    table.update("m", [Endpoint("a", "127.0.0.1", 1, 2)])
    gateway = RestGateway(table, pool=Pool())  # type: ignore[arg-type]
    seen: list[tuple[int, int, int]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.body":
            t = table.tenant_traffic("admin", "m")  # the tenant of a gateway without a guard
            seen.append((t.requests, t.bytes_in, t.bytes_out))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/infer",
        "raw_path": b"/v2/models/m/infer",
        "query_string": b"",
        "headers": [(b"content-length", b"2")],
    }
    await gateway(scope, receive, send)  # type: ignore[arg-type]
    assert seen == [(1, 2, len(b'{"outputs": []}'))]


def test_readmission_ends_only_an_ejection() -> None:
    """The controller readmits after every probe that passes: an endpoint not ejected keeps its failures, one no
    longer routed is not touched, and the replica's current endpoint is the one readmitted."""
    table = RouteTable(now=FakeClock())
    a = Endpoint("a", "127.0.0.1", 1, 2)
    table.update("m", [a])
    table.failed(a)
    assert table.readmit("a") is False and a.failures == 1
    assert table.readmit("nobody") is False
    moved = Endpoint("a", "127.0.0.1", 5, 6)  # the replica moved: a new endpoint
    table.update("m", [moved])
    assert table.endpoint("a") is moved
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        table.failed(moved)
    assert table.readmit("a") is True and table.choose("m") is moved
    table.drop_endpoint("a")
    assert table.endpoint("a") is None and table.readmit("a") is False
