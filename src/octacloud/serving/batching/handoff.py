"""Where a batch is computed: on a model thread, or on the event loop itself when batches are short.

Handing a batch to a worker thread and its result back costs the process about four futex calls, one eventfd
write, one more loop wake-up and a GIL hand-over per batch (strace under perf_analyzer). For a model whose
batches take a few hundred microseconds that costs as much CPU as the model itself, and buys nothing on a
host whose cores are busy anyway. So a batch that is expected to be short runs inline, on the loop; every
other one, and every batch of a model with more than one instance, goes to the thread pool.

Policy (:class:`InlinePolicy`, pure): an exponentially weighted mean of the measured compute time per batch;
inline once it is below ``inline_below_ns`` (after ``min_samples`` batches), back to the thread once it is
above twice that. Mechanism (:class:`BatchHandoff`): runs each batch where the policy says and feeds it the
time measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

INLINE_ENV = "OCTACLOUD_INLINE_BATCH_US"
DEFAULT_INLINE_BELOW_US = 1000


def threshold_us() -> int:
    """The inline threshold: ``$OCTACLOUD_INLINE_BATCH_US`` (0 turns inline batches off), else 1000 us."""
    raw = os.environ.get(INLINE_ENV, "")
    try:
        return max(0, int(raw)) if raw else DEFAULT_INLINE_BELOW_US
    except ValueError:
        raise ValueError(f"{INLINE_ENV} must be a whole number of microseconds, got {raw!r}") from None


@dataclass(slots=True)
class InlinePolicy:
    """Decides from measured compute times whether the next batch runs inline. Pure; no clock."""

    inline_below_ns: int
    min_samples: int = 8
    weight: float = 0.1
    mean_ns: float = 0.0
    samples: int = 0
    inline: bool = False

    def observe(self, compute_ns: int) -> None:
        self.samples += 1
        self.mean_ns = compute_ns if self.samples == 1 else self.mean_ns + self.weight * (compute_ns - self.mean_ns)
        if self.inline_below_ns <= 0 or self.samples < self.min_samples:
            self.inline = False
        elif self.inline:
            self.inline = self.mean_ns <= 2 * self.inline_below_ns
        else:
            self.inline = self.mean_ns < self.inline_below_ns


class BatchHandoff:
    """Runs a model's batches inline or on ``executor``, as :class:`InlinePolicy` says (inline only with one
    instance: the runtime is then never called concurrently, as :class:`ModelRuntime` requires)."""

    def __init__(self, executor: Executor, instances: int, inline_below_us: int | None = None) -> None:
        below = threshold_us() if inline_below_us is None else inline_below_us
        self.policy = InlinePolicy(below * 1000 if instances == 1 else 0)
        self._executor = executor

    async def run(self, fn: Callable[[], T]) -> T:
        if self.policy.inline:
            t0 = time.perf_counter_ns()
            try:
                return fn()
            finally:
                self.policy.observe(time.perf_counter_ns() - t0)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn)

    def _timed(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter_ns()
        try:
            return fn()
        finally:  # the policy's fields are plain numbers: written here, read on the loop between batches
            self.policy.observe(time.perf_counter_ns() - t0)


__all__ = ["BatchHandoff", "InlinePolicy", "threshold_us"]
