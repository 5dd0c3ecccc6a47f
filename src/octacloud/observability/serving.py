"""Serving metrics under Triton's names, exported by prometheus_client from a per-server registry.

The counters are read at scrape time from the statistics the serving layer keeps anyway (nothing is counted
twice on the hot path). Samples carry exactly Triton's names and labels ``model`` and ``version``; they are
exposed as ``untyped`` because prometheus_client would append ``_total`` to a counter's name, which Triton's
dashboards do not expect. Durations are cumulative microseconds, as in Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# name -> (help, how to read it from a stats object)
REQUEST_SUCCESS = "nv_inference_request_success"
REQUEST_FAILURE = "nv_inference_request_failure"
INFERENCE_COUNT = "nv_inference_count"
EXEC_COUNT = "nv_inference_exec_count"
REQUEST_DURATION = "nv_inference_request_duration_us"
QUEUE_DURATION = "nv_inference_queue_duration_us"
COMPUTE_INPUT_DURATION = "nv_inference_compute_input_duration_us"
COMPUTE_INFER_DURATION = "nv_inference_compute_infer_duration_us"
COMPUTE_OUTPUT_DURATION = "nv_inference_compute_output_duration_us"
PENDING_REQUESTS = "nv_inference_pending_request_count"


class DurationLike(Protocol):
    @property
    def count(self) -> int: ...

    @property
    def ns(self) -> int: ...


class StatsLike(Protocol):
    """What the collector reads of one model version's statistics (``octacloud.serving.stats.ModelStats``)."""

    @property
    def success(self) -> DurationLike: ...

    @property
    def fail(self) -> DurationLike: ...

    @property
    def queue(self) -> DurationLike: ...

    @property
    def compute_input(self) -> DurationLike: ...

    @property
    def compute_infer(self) -> DurationLike: ...

    @property
    def compute_output(self) -> DurationLike: ...

    @property
    def inference_count(self) -> int: ...

    @property
    def execution_count(self) -> int: ...


class VersionStatsLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def stats(self) -> StatsLike: ...

    @property
    def pending(self) -> int: ...


_COUNTERS: tuple[tuple[str, str, Callable[[StatsLike], float]], ...] = (
    (REQUEST_SUCCESS, "Number of successful inference requests, all batch sizes", lambda s: s.success.count),
    (REQUEST_FAILURE, "Number of failed inference requests, all batch sizes", lambda s: s.fail.count),
    (INFERENCE_COUNT, "Number of inferences performed (batch samples)", lambda s: s.inference_count),
    (EXEC_COUNT, "Number of model executions performed (batches)", lambda s: s.execution_count),
    (
        REQUEST_DURATION,
        "Cumulative inference request duration in microseconds",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (QUEUE_DURATION, "Cumulative inference queuing duration in microseconds", lambda s: s.queue.ns // 1000),
    (COMPUTE_INPUT_DURATION, "Cumulative compute input duration in microseconds", lambda s: s.compute_input.ns // 1000),
    (
        COMPUTE_INFER_DURATION,
        "Cumulative compute inference duration in microseconds",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        COMPUTE_OUTPUT_DURATION,
        "Cumulative inference compute output duration in microseconds",
        lambda s: s.compute_output.ns // 1000,
    ),
)
LABELS = ("model", "version")
COLD_START = "octacloud_replica_cold_start_seconds"


class ServingCollector(Collector):  # type: ignore[misc]
    """Yields Triton's inference metrics for every loaded model version that ``source`` returns."""

    def __init__(self, source: Callable[[], Iterable[VersionStatsLike]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        versions = list(self._source())
        for name, doc, read in _COUNTERS:
            metric = Metric(name, doc, "unknown")
            for v in versions:
                metric.add_sample(name, {"model": v.name, "version": v.version}, float(read(v.stats)))
            yield metric
        pending = GaugeMetricFamily(
            PENDING_REQUESTS, "Instantaneous number of pending requests awaiting execution per-model.", labels=LABELS
        )
        for v in versions:
            pending.add_metric([v.name, v.version], float(v.pending))
        yield pending
        cold = GaugeMetricFamily(
            COLD_START,
            "Seconds the model version's start took, by part: fetch, load, warmup.",
            labels=(*LABELS, "part"),
        )
        for v in versions:
            for part, seconds in sorted(getattr(v, "cold_start", {}).items()):
                cold.add_metric([v.name, v.version, part], float(seconds))
        yield cold


def serving_registry(source: Callable[[], Iterable[VersionStatsLike]]) -> CollectorRegistry:
    """A fresh registry (not the global one) holding the serving metrics, so that tests can run several."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(source))
    return registry
