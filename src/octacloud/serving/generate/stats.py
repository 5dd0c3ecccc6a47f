"""What a generative model version measured: tokens, latencies of the stream, and the KV cache it holds.

Histograms keep cumulative counts per bucket (Prometheus' convention), in seconds. The figures are the ones the
field reads (vLLM's names, which Triton's vLLM backend also exports; ``observability/serving.py`` names them):

- time to first token: from the request's arrival at the replica to its first generated token;
- inter-token latency: between two generated tokens of one sequence;
- queue time: arrival until the engine began the prompt (first token time less the engine's prompt time);
- end-to-end latency, prompt and generation tokens, and the streams running and waiting;
- KV cache use: tokens the sequences in flight hold (prompt + generated so far) over the cache's size.

Updated on the event loop only; read by the metrics thread (plain ints and lists: a read may see a request
half-counted, never a torn value).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
LATENCY_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, ``+Inf`` last, as a Prometheus histogram's buckets."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass(slots=True)
class GenerationStats:
    """Counters of one generative model version (see the module docstring)."""

    kv_capacity_tokens: int
    slots: int
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    """Sequences whose client went away before their end (their generation was stopped)."""
    refused_context: int = 0
    """Requests refused before they queued because their context does not fit a sequence."""
    running: int = 0
    """Sequences in flight (each request counts ``n``)."""
    kv_tokens: int = 0
    """Tokens the sequences in flight hold in the cache."""

    @property
    def waiting(self) -> int:
        """Sequences in flight beyond the engine's slots: they wait for one."""
        return max(0, self.running - self.slots)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache the sequences in flight hold (0..1)."""
        return min(1.0, self.kv_tokens / self.kv_capacity_tokens) if self.kv_capacity_tokens else 0.0
