"""Routing: power of two choices on outstanding requests, skipping failed and excluded replicas."""

from __future__ import annotations

import random

from octacloud.cluster.gateway.grpc_proxy import model_name
from octacloud.cluster.gateway.routing import MAX_CONSECUTIVE_FAILURES, Endpoint, RouteTable


def test_prefers_less_loaded_and_skips_failed() -> None:
    table = RouteTable(rng=random.Random(1))
    busy, idle = Endpoint("a", "127.0.0.1", 1, 2, outstanding=5), Endpoint("b", "127.0.0.1", 3, 4)
    table.update("m", [busy, idle])
    assert all(table.choose("m") is idle for _ in range(20))
    assert table.choose("m", exclude=["b"]) is busy
    idle.failures = MAX_CONSECUTIVE_FAILURES
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
