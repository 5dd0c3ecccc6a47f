"""Per-model-version statistics, as Triton's statistics extension reports them.

Durations are cumulative nanoseconds. As in Triton, the ``queue`` and ``compute_*`` entries count requests
(each request of a batch is charged the batch's compute durations); ``execution_count`` counts batches and
``inference_count`` counts rows (samples).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass(slots=True)
class BatchSizeStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class ModelStats:
    """Counters of one model version. Updated on the event loop only (no locks needed)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch_stats: dict[int, BatchSizeStats] = field(default_factory=dict)

    def on_batch(self, rows: int, queue_ns: Sequence[int], input_ns: int, infer_ns: int, output_ns: int) -> None:
        n = len(queue_ns)
        self.queue.add(sum(queue_ns), n)
        self.compute_input.add(input_ns * n, n)
        self.compute_infer.add(infer_ns * n, n)
        self.compute_output.add(output_ns * n, n)
        self.inference_count += rows
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        b = self.batch_stats.get(rows)
        if b is None:
            b = self.batch_stats[rows] = BatchSizeStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def on_batch_failed(self, rows: int, queue_ns: Sequence[int]) -> None:
        self.queue.add(sum(queue_ns), len(queue_ns))

    def on_request(self, ok: bool, duration_ns: int) -> None:
        (self.success if ok else self.fail).add(duration_ns)
