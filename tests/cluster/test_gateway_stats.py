"""Merging replicas' statistics into the deployment's (gateway.stats): pure, on Triton's statistics JSON."""

from __future__ import annotations

from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from octacloud.gateway.stats import merge_model_statistics


def _entry(count: int, last: int, ns: int, batches: dict[int, int]) -> dict[str, object]:
    return {
        "name": "m",
        "version": "1",
        "last_inference": last,
        "inference_count": count,
        "execution_count": sum(batches.values()),
        "inference_stats": {"success": {"count": count, "ns": ns}, "fail": {"count": 0, "ns": 0}},
        "batch_stats": [
            {"batch_size": b, "compute_infer": {"count": n, "ns": 10 * n}} for b, n in sorted(batches.items())
        ],
    }


def test_counters_sum_latest_wins_and_batch_sizes_are_matched() -> None:
    a = {"model_stats": [_entry(5, 100, 50, {1: 3, 2: 1})]}
    b = {"model_stats": [_entry(7, 90, 70, {2: 2, 4: 1})]}
    [m] = merge_model_statistics([a, b])["model_stats"]
    assert m["inference_count"] == 12
    assert m["last_inference"] == 100
    assert m["execution_count"] == 7
    assert m["inference_stats"] == {"success": {"count": 12, "ns": 120}, "fail": {"count": 0, "ns": 0}}
    assert [(s["batch_size"], s["compute_infer"]["count"]) for s in m["batch_stats"]] == [(1, 3), (2, 3), (4, 1)]


def test_versions_stay_apart_and_one_replica_is_returned_as_is() -> None:
    a = {"model_stats": [_entry(5, 100, 50, {1: 5})]}
    other = _entry(2, 10, 5, {1: 2})
    other["version"] = "2"
    b = {"model_stats": [_entry(1, 1, 1, {1: 1}), other]}
    merged = merge_model_statistics([a, b])["model_stats"]
    assert [(m["version"], m["inference_count"]) for m in merged] == [("1", 6), ("2", 2)]
    assert merge_model_statistics([a]) == a
    assert merge_model_statistics([]) == {"model_stats": []}


def test_grpc_messages_round_trip_with_64_bit_counters_as_strings() -> None:
    def message(count: int, batches: dict[int, int]) -> dict[str, object]:
        response = json_format.ParseDict(
            {"model_stats": [_entry(count, 7, 3, batches)]}, service_pb2.ModelStatisticsResponse()
        )
        return json_format.MessageToDict(response, preserving_proto_field_name=True)

    one, two = message(2**40, {8: 1}), message(3, {8: 2})
    assert one["model_stats"][0]["inference_count"] == str(2**40)  # what MessageToDict gives for uint64
    merged = json_format.ParseDict(merge_model_statistics([one, two]), service_pb2.ModelStatisticsResponse())
    stats = merged.model_stats[0]
    assert stats.inference_count == 2**40 + 3
    assert stats.inference_stats.success.ns == 6
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(8, 3)]
