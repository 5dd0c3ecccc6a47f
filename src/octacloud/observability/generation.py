"""A generative deployment's figures, summed over its replicas from their scraped metrics (vLLM's names, see
``observability/serving.py``): what the dashboard and ``octacloud top`` show for it.

Histograms are summed bucket by bucket, so the quantiles are the deployment's (each the upper bound of the
bucket where the quantile falls, as Prometheus' ``histogram_quantile`` reads them without interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
QUEUE = "vllm:request_queue_time_seconds"
_HISTOGRAMS = {TTFT: "ttft", ITL: "itl", QUEUE: "queue"}
_TOTALS = {
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "octacloud_generation_aborted_total": "aborted",
}
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(slots=True)
class GenerationFigures:
    ttft: dict[float, float] = field(default_factory=dict)
    """Cumulative bucket counts by upper bound (seconds; ``inf`` last)."""
    itl: dict[float, float] = field(default_factory=dict)
    queue: dict[float, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    aborted: float = 0.0
    kv_usage: list[float] = field(default_factory=list)
    """Each replica's KV cache use (0..1)."""

    def add(self, other: GenerationFigures) -> None:
        for name in _HISTOGRAMS.values():
            mine = getattr(self, name)
            for bound, count in getattr(other, name).items():
                mine[bound] = mine.get(bound, 0.0) + count
        for name in _TOTALS.values():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.kv_usage += other.kv_usage

    def as_dict(self) -> dict[str, float | None]:
        return {
            "ttft_p50_ms": _ms(quantile(self.ttft, 0.5)),
            "ttft_p99_ms": _ms(quantile(self.ttft, 0.99)),
            "itl_p50_ms": _ms(quantile(self.itl, 0.5)),
            "itl_p99_ms": _ms(quantile(self.itl, 0.99)),
            "queue_p99_ms": _ms(quantile(self.queue, 0.99)),
            "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens,
            "running": self.running,
            "waiting": self.waiting,
            "aborted": self.aborted,
            "kv_cache_usage": max(self.kv_usage) if self.kv_usage else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isinf(seconds) else round(seconds * 1000, 2)


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket where the ``q`` quantile falls; None without observations."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    want = q * ordered[-1][1]
    return next(bound for bound, count in ordered if count >= want)


def figures(families: Iterable[Metric]) -> GenerationFigures | None:
    """A replica's generation figures from its metric families; None when it serves no generative model."""
    out: GenerationFigures | None = None
    for family in families:
        name = family.name
        if name in _HISTOGRAMS or name in _TOTALS or name == KV_USAGE or name + "_total" in _TOTALS:
            out = out or GenerationFigures()
        else:
            continue
        for sample in family.samples:
            if name in _HISTOGRAMS and sample.name == name + "_bucket":
                bound = float(sample.labels["le"])
                histogram = getattr(out, _HISTOGRAMS[name])
                histogram[bound] = histogram.get(bound, 0.0) + sample.value
            elif sample.name in _TOTALS:
                field_name = _TOTALS[sample.name]
                setattr(out, field_name, getattr(out, field_name) + sample.value)
            elif sample.name == KV_USAGE:
                out.kv_usage.append(sample.value)
    return out
