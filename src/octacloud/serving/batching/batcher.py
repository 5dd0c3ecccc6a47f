"""The dynamic batching MECHANISM: an asyncio queue around one model, driven by :class:`BatchPolicy`.

Requests are queued with a future each. Whenever a model instance is free and the queue changed (or the time
the policy asked to be woken at came), the policy decides; a batch is concatenated along the batch dim, run
by the :class:`BatchRunner` (off the event loop), and split back, each request getting exactly its rows.
A request larger than the cap is split into chunks that queue on their own and are re-joined in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from octacloud.core.clock import Clock, SystemClock
from octacloud.idlespin import poke
from octacloud.serving.batching.policy import BatchingSettings, BatchPolicy, Pending
from octacloud.serving.errors import ModelExecutionError, ModelNotReadyError, QueueFullError, QueueTimeoutError

Arrays = Mapping[str, npt.NDArray[Any]]
BatchRunner = Callable[[Arrays], Awaitable[dict[str, npt.NDArray[Any]]]]
"""Computes one batch (off the event loop); returns every output with the batch dim first."""


class BatchObserver(Protocol):
    """Told about every batch run (for statistics and metrics). Must not raise or block."""

    def on_batch(self, rows: int, queue_ns: Sequence[int], input_ns: int, infer_ns: int, output_ns: int) -> None: ...

    def on_batch_failed(self, rows: int, queue_ns: Sequence[int]) -> None: ...


@dataclass(slots=True)
class _Item(Pending):
    inputs: Arrays | None = None
    future: asyncio.Future[dict[str, npt.NDArray[Any]]] | None = None
    enqueued_ns: int = 0


def batch_group(inputs: Arrays) -> Hashable:
    """What requests must share to be concatenated into one batch: each input's dtype and shape after the batch
    axis (text of different lengths, say, runs in separate batches instead of failing together)."""
    return tuple((k, v.dtype.str, v.shape[1:]) for k, v in sorted(inputs.items()))


class DynamicBatcher:
    """Queues requests for one model and runs them in batches on ``instances`` concurrent runners."""

    def __init__(
        self,
        settings: BatchingSettings,
        runner: BatchRunner,
        *,
        name: str = "model",
        instances: int = 1,
        cap: Callable[[], int] | None = None,
        observer: BatchObserver | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self._policy = BatchPolicy(settings)
        self._runner = runner
        self._cap = cap or (lambda: max(1, settings.max_batch_size))
        self._observer = observer
        self._clock = clock or SystemClock()
        self._free = instances
        self._queue: list[_Item] = []
        self._counts: dict[int, int] = {}
        self._running: set[asyncio.Task[None]] = set()
        self._wakeup: asyncio.Future[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._timed = False  # some request ever had a deadline: check timeouts even while busy
        self._batch_s = 0.0  # mean compute time of a batch (exponentially weighted)

    @property
    def pending(self) -> int:
        """Requests (chunks) waiting in the queue."""
        return len(self._queue)

    @property
    def cap(self) -> int:
        return max(1, min(self._cap(), self.settings.max_batch_size)) if self.settings.max_batch_size else 1

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher:{self.name}")

    async def submit(
        self, inputs: Arrays, rows: int = 1, *, priority: int = 0, timeout_us: int = 0, tenant: str = ""
    ) -> dict[str, npt.NDArray[Any]]:
        """Queue one request of ``rows`` rows (1 for a model without batching) and wait for its outputs.
        ``tenant`` ("" unknown) matters only with ``isolate_tenants``."""
        if self._closed:
            raise ModelNotReadyError(f"model {self.name!r} is unloading; retry")
        cap = self.cap if self.settings.max_batch_size else rows
        if rows <= cap:
            return await self._enqueue(inputs, rows, priority, timeout_us, tenant)
        starts = range(0, rows, cap)
        parts = await asyncio.gather(
            *(
                self._enqueue(
                    {k: v[s : s + cap] for k, v in inputs.items()}, min(cap, rows - s), priority, timeout_us, tenant
                )
                for s in starts
            )
        )
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _enqueue(
        self, inputs: Arrays, rows: int, priority: int, timeout_us: int, tenant: str = ""
    ) -> asyncio.Future[dict[str, npt.NDArray[Any]]]:
        s = self.settings
        level = s.level_of(priority)
        if s.max_pending and len(self._queue) >= s.max_pending:
            raise QueueFullError(
                f"model {self.name!r} has {len(self._queue)} requests waiting, the most it queues "
                f"(parameter octacloud.max_pending); retry later"
            )
        limit = s.queue_policy(level).max_queue_size
        if limit and self._counts.get(level, 0) >= limit:
            raise QueueFullError(
                f"model {self.name!r}: the queue{f' of priority {level}' if level else ''} is full "
                f"(max_queue_size {limit}); retry later"
            )
        now = self._clock.monotonic()
        if len(self._queue) >= self.cap:  # more than a batch waits: a stalled loop alone refuses no one
            limit_s = s.refuse_after_s(self._batch_s)
            waited = now - self._queue[0].arrival
            if limit_s is not None and waited > limit_s:
                raise QueueFullError(
                    f"model {self.name!r} is overloaded: its oldest waiting request has waited {waited * 1e3:.0f} ms, "
                    f"more than {limit_s * 1e3:.0f} ms (parameter octacloud.max_queue_wait_us); retry later"
                )
        deadline, reject = s.deadline_of(now, level, timeout_us)
        future: asyncio.Future[dict[str, npt.NDArray[Any]]] = asyncio.get_running_loop().create_future()
        group: Hashable = batch_group(inputs)
        alone = s.isolate_tenants and not tenant  # one tenant per batch; a request of unknown tenant alone
        if s.isolate_tenants:
            group = (group, tenant or object())
        item = _Item(now, rows, level, deadline, reject, group, alone, inputs, future, time.perf_counter_ns())
        self._queue.append(item)
        self._timed = self._timed or deadline is not None
        self._counts[level] = self._counts.get(level, 0) + 1
        self._wake()
        return future

    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed and not self._queue:
                return
            batch: list[_Item] = []
            wake_at: float | None = None
            if self._queue and (self._free > 0 or self._timed):
                self._queue = [i for i in self._queue if not self._drop_if_cancelled(i)]
                now = self._clock.monotonic()
                if self._free > 0:
                    decision = self._policy.decide(self._queue, now, self.cap)
                    expired, chosen, wake_at = decision.expired, decision.batch, decision.wake_at
                else:  # busy: only timeouts can change anything before an instance frees
                    expired, wake_at = self._policy.expire(self._queue, now)
                    chosen = ()
                if expired or chosen:
                    gone = set(chosen) | set(expired)
                    batch = [self._queue[i] for i in chosen]
                    for i in expired:
                        self._fail(
                            self._queue[i],
                            QueueTimeoutError(
                                f"model {self.name!r}: request timed out in the queue; retry or raise the timeout"
                            ),
                        )
                    self._queue = [it for n, it in enumerate(self._queue) if n not in gone]
                    for it in batch:
                        self._counts[it.priority] -= 1
            if batch:
                self._free -= 1
                task = loop.create_task(self._execute(batch))
                self._running.add(task)
                task.add_done_callback(self._done)
                continue
            self._wakeup = loop.create_future()
            timer = None
            if wake_at is not None:
                timer = loop.call_later(max(0.0, wake_at - self._clock.monotonic()), self._wake)
            try:
                await self._wakeup
            finally:
                if timer is not None:
                    timer.cancel()
                self._wakeup = None

    def _drop_if_cancelled(self, item: _Item) -> bool:
        if item.future is not None and item.future.done():
            self._counts[item.priority] -= 1
            return True
        return False

    def _fail(self, item: _Item, error: Exception) -> None:
        self._counts[item.priority] -= 1
        if item.future is not None and not item.future.done():
            item.future.set_exception(error)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._free += 1
        self._wake()

    async def _execute(self, batch: list[_Item]) -> None:
        t0 = time.perf_counter_ns()
        queue_ns = [t0 - it.enqueued_ns for it in batch]
        rows = sum(it.rows for it in batch)
        try:
            if len(batch) == 1:
                inputs = batch[0].inputs or {}
            else:
                first = batch[0].inputs or {}
                inputs = {k: np.concatenate([it.inputs[k] for it in batch if it.inputs]) for k in first}
            t1 = time.perf_counter_ns()
            outputs = await self._runner(inputs)
            t2 = time.perf_counter_ns()
            self._batch_s += 0.1 * ((t2 - t1) / 1e9 - self._batch_s)
            if len(batch) == 1:
                parts = [outputs]
            else:
                for k, v in outputs.items():
                    if v.ndim == 0 or v.shape[0] != rows:
                        raise ModelExecutionError(
                            f"model {self.name!r}: output {k!r} has shape {list(v.shape)}, expected {rows} rows"
                        )
                parts, start = [], 0
                for it in batch:
                    parts.append({k: v[start : start + it.rows] for k, v in outputs.items()})
                    start += it.rows
            t3 = time.perf_counter_ns()
        except Exception as e:  # the model failed: fail this batch only
            error = (
                e
                if isinstance(e, ModelExecutionError)
                else ModelExecutionError(f"model {self.name!r} failed: {type(e).__name__}: {e}")
            )
            for it in batch:
                if it.future is not None and not it.future.done():
                    it.future.set_exception(error)
            if self._observer is not None:
                self._observer.on_batch_failed(rows, queue_ns)
            return
        for it, part in zip(batch, parts, strict=True):
            if it.future is not None and not it.future.done():
                it.future.set_result(part)
        poke()  # a batch's compute was work: an idle-spinning loop polls on after it (idlespin.py)
        if self._observer is not None:
            self._observer.on_batch(rows, queue_ns, t1 - t0, t2 - t1, t3 - t2)

    async def close(self) -> None:
        """Stop taking requests, run what is queued, wait for running batches, stop the loop."""
        self._closed = True
        self._wake()
        if self._loop_task is not None:
            await self._loop_task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
