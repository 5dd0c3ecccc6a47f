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
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
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


class HistogramLike(Protocol):
    @property
    def total(self) -> float: ...

    def cumulative(self) -> list[tuple[str, int]]: ...


class GenerationLike(Protocol):
    """What the collector reads of a generative version's measures (``octacloud.serving.generate.stats``)."""

    @property
    def ttft(self) -> HistogramLike: ...

    @property
    def itl(self) -> HistogramLike: ...

    @property
    def queue(self) -> HistogramLike: ...

    @property
    def e2e(self) -> HistogramLike: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def generation_tokens(self) -> int: ...

    @property
    def requests_finished(self) -> int: ...

    @property
    def requests_aborted(self) -> int: ...

    @property
    def refused_context(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...


class VersionStatsLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def stats(self) -> StatsLike: ...

    @property
    def pending(self) -> int: ...

    @property
    def generation(self) -> GenerationLike | None: ...


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
        generative = [(v, v.generation) for v in versions if v.generation is not None]
        if generative:
            yield from _generation(generative)


TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GENERATIONS_FINISHED = "octacloud_generation_finished_total"
GENERATIONS_ABORTED = "octacloud_generation_aborted_total"
CONTEXT_REFUSED = "octacloud_generation_context_refused_total"
_GENERATION_HISTOGRAMS: tuple[tuple[str, str, Callable[[GenerationLike], HistogramLike]], ...] = (
    (TIME_TO_FIRST_TOKEN, "Time from a request's arrival to its first generated token, seconds.", lambda g: g.ttft),
    (INTER_TOKEN_LATENCY, "Time between two generated tokens of one sequence, seconds.", lambda g: g.itl),
    (QUEUE_TIME, "Time a request waited before the engine began its prompt, seconds.", lambda g: g.queue),
    (E2E_LATENCY, "Time from a request's arrival to its end, seconds.", lambda g: g.e2e),
)
_GENERATION_COUNTS: tuple[tuple[str, str, str, Callable[[GenerationLike], float]], ...] = (
    (PROMPT_TOKENS, "Prompt tokens processed.", "unknown", lambda g: g.prompt_tokens),
    (GENERATION_TOKENS, "Tokens generated.", "unknown", lambda g: g.generation_tokens),
    (GENERATIONS_FINISHED, "Generation requests that ran to their end.", "unknown", lambda g: g.requests_finished),
    (GENERATIONS_ABORTED, "Generations stopped: their client went away.", "unknown", lambda g: g.requests_aborted),
    (CONTEXT_REFUSED, "Requests refused because their context did not fit.", "unknown", lambda g: g.refused_context),
    (REQUESTS_RUNNING, "Sequences being generated now (the engine's slots in use).", "gauge", lambda g: g.running),
    (REQUESTS_WAITING, "Sequences waiting for an engine slot now.", "gauge", lambda g: g.waiting),
    (KV_CACHE_USAGE, "Share of the KV cache the sequences in flight hold (0..1).", "gauge", lambda g: g.kv_usage),
)
"""Generative models' measures under vLLM's names (the ones Triton's vLLM backend and KServe's dashboards read;
``..._total`` counters are written as vLLM writes them, untyped so that no suffix is added)."""


def _generation(versions: list[tuple[VersionStatsLike, GenerationLike]]) -> Iterator[Metric]:
    for name, doc, read in _GENERATION_HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        for v, g in versions:
            histogram = read(g)
            family.add_metric([v.name, v.version], histogram.cumulative(), histogram.total)
        yield family
    for name, doc, kind, value in _GENERATION_COUNTS:
        metric = Metric(name, doc, kind)
        for v, g in versions:
            metric.add_sample(name, {"model": v.name, "version": v.version}, float(value(g)))
        yield metric


def serving_registry(source: Callable[[], Iterable[VersionStatsLike]]) -> CollectorRegistry:
    """A fresh registry (not the global one) holding the serving metrics, so that tests can run several."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(source))
    return registry
