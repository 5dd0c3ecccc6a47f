"""The dynamic batching POLICY: pure decisions over the queue's state and the time. No asyncio, no clock.

Given the requests waiting (in arrival order) and ``now``, :meth:`BatchPolicy.decide` says which requests to
reject for timeout, which to run now as one batch (and in what order), or when to ask again. The mechanism
(:mod:`octacloud.serving.batching.batcher`) asks whenever a model instance is free and something changed.

Triton's options are honoured: ``max_batch_size``, ``preferred_batch_size``, ``max_queue_delay_microseconds``,
``priority_levels`` / ``default_priority_level``, and per-level queue policies (timeout with REJECT or DELAY,
``allow_timeout_override``, ``max_queue_size``). The design's default is added: a batch is dispatched as soon as
more than 3 requests wait (``merge_after`` = 4), or when the oldest has waited the delay (2 ms by default).
With ``isolate_requests`` every batch is one request (or one chunk of it), run as soon as an instance is free.
Requests of different ``group`` (input shapes after the batch axis; with ``isolate_tenants`` also the tenant)
never share a batch: the first request's group is batched, the others wait their turn; a request marked
``alone`` is run as soon as an instance is free.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.repository.config import int_parameter

MERGE_AFTER = 4
"""Dispatch once this many requests wait (the design: 'more than 3')."""
PENDING_PARAMETER = "octacloud.max_pending"
PENDING_PER_BATCH = 8
MIN_PENDING = 64
"""Unless the config's ``octacloud.max_pending`` parameter says otherwise (0: unbounded), a model queues at
most max(64, 8 × max_batch_size) requests; more are refused at once (503 / UNAVAILABLE, "retry later"). Under
open-loop load beyond capacity the queue, and with it the latency of every admitted request, then stays
bounded (about eight batches' worth) instead of growing until clients time out."""
WAIT_PARAMETER = "octacloud.max_queue_wait_us"
MIN_QUEUE_WAIT_S = 0.05
"""New requests are also refused while a full batch or more waits and the oldest has waited longer than the config's
``octacloud.max_queue_wait_us`` (0: never), by default max(50 ms, 10 × max_queue_delay, 4 × the mean compute
time of a batch): the queue holds more work than the model gets through, so what is admitted stays fast."""


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One priority level's queue policy (Triton's ``ModelQueuePolicy``). 0 means unlimited / none."""

    timeout_us: int = 0
    reject_on_timeout: bool = True
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    @classmethod
    def from_proto(cls, p: mc.ModelQueuePolicy) -> QueuePolicy:
        return cls(
            timeout_us=p.default_timeout_microseconds,
            reject_on_timeout=p.timeout_action == mc.ModelQueuePolicy.REJECT,
            allow_timeout_override=p.allow_timeout_override,
            max_queue_size=p.max_queue_size,
        )


@dataclass(frozen=True, slots=True)
class BatchingSettings:
    """What the policy needs from a model's config. ``max_batch_size`` 0: every request runs alone."""

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 2000
    merge_after: int = MERGE_AFTER
    priority_levels: int = 0
    default_priority: int = 0
    default_queue: QueuePolicy = QueuePolicy()
    queues: Mapping[int, QueuePolicy] = field(default_factory=dict)
    isolate_requests: bool = False
    """Never put two requests in one batch (``batch_isolation: "requests"``)."""
    isolate_tenants: bool = False
    """Put only one tenant's requests in a batch, and a request of unknown tenant alone: for models whose rows
    are coupled within a batch (dynamic quantization's per-batch activation scale), so that one tenant's
    results never depend on another's. The mechanism makes it part of each request's ``group``."""
    max_pending: int = 0
    """The most requests (chunks) waiting at once, over all levels; 0: unbounded."""
    max_queue_wait_us: int | None = None
    """Refuse new requests while the oldest has waited longer; None: automatic (see MIN_QUEUE_WAIT_S); 0: never."""

    def refuse_after_s(self, batch_s: float) -> float | None:
        """How long the oldest waiting request may have waited before new ones are refused (None: never),
        given the mean compute time of a batch."""
        if self.max_queue_wait_us is not None:
            return self.max_queue_wait_us / 1e6 if self.max_queue_wait_us > 0 else None
        return max(MIN_QUEUE_WAIT_S, 10 * self.max_queue_delay_us / 1e6, 4 * batch_s)

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> BatchingSettings:
        given = int_parameter(config, PENDING_PARAMETER)
        if given is not None and given < 0:
            raise ModelConfigError(f"parameter {PENDING_PARAMETER} must be >= 0 (0: unbounded), got {given}")
        pending = given if given is not None else max(MIN_PENDING, PENDING_PER_BATCH * max(0, config.max_batch_size))
        wait = int_parameter(config, WAIT_PARAMETER)
        if config.max_batch_size <= 0 or not config.HasField("dynamic_batching"):
            return cls(
                max_batch_size=max(0, config.max_batch_size),
                max_queue_delay_us=0,
                merge_after=1,
                max_pending=pending,
                max_queue_wait_us=wait,
            )
        db = config.dynamic_batching
        return cls(
            max_pending=pending,
            max_queue_wait_us=wait,
            max_batch_size=config.max_batch_size,
            preferred_batch_sizes=tuple(sorted(db.preferred_batch_size)),
            max_queue_delay_us=db.max_queue_delay_microseconds,
            priority_levels=db.priority_levels,
            default_priority=db.default_priority_level,
            default_queue=QueuePolicy.from_proto(db.default_queue_policy),
            queues={int(k): QueuePolicy.from_proto(v) for k, v in db.priority_queue_policy.items()},
        )

    def queue_policy(self, priority: int) -> QueuePolicy:
        return self.queues.get(priority, self.default_queue)

    def level_of(self, requested: int) -> int:
        """The priority level a request gets: its own if valid (1 is highest), else the default."""
        if self.priority_levels and 0 < requested <= self.priority_levels:
            return requested
        return self.default_priority

    def deadline_of(self, arrival: float, level: int, requested_timeout_us: int) -> tuple[float | None, bool]:
        """(deadline or None, reject on timeout) of a request arriving at ``arrival``."""
        policy = self.queue_policy(level)
        timeout_us = policy.timeout_us
        if requested_timeout_us and (policy.allow_timeout_override or not timeout_us):
            timeout_us = requested_timeout_us if not timeout_us else min(timeout_us, requested_timeout_us)
        if timeout_us <= 0:
            return None, policy.reject_on_timeout
        return arrival + timeout_us / 1e6, policy.reject_on_timeout


@dataclass(slots=True)
class Pending:
    """What the policy sees of one queued request (or of one chunk of a request larger than the cap)."""

    arrival: float
    rows: int = 1
    priority: int = 0
    deadline: float | None = None
    reject_on_timeout: bool = True
    group: Hashable = None
    """Requests of different groups never share a batch (the mechanism groups by the shapes and types of the
    inputs after the batch axis: a batch is one array per input, and one odd request must not fail the others)."""
    alone: bool = False
    """Shares a batch with no one (a request of unknown tenant under ``isolate_tenants``): run as soon as an
    instance is free, without waiting for company."""


@dataclass(frozen=True, slots=True)
class Decision:
    """``expired``: indices to reject now; ``batch``: indices to run now, in order (empty: none);
    ``wake_at``: when to ask again if nothing arrives (None: only on arrival)."""

    batch: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    wake_at: float | None = None


class BatchPolicy:
    """Decides when to run which waiting requests as one batch. Pure: same inputs, same decision."""

    def __init__(self, settings: BatchingSettings) -> None:
        self.settings = settings
        self._delay = settings.max_queue_delay_us / 1e6
        self._ordered = bool(settings.priority_levels)

    def decide(self, queue: Sequence[Pending], now: float, cap: int) -> Decision:
        """The decision for ``queue`` (arrival order) at ``now``; ``cap`` is the most rows in one batch.

        Every request's ``rows`` is at most ``cap`` (the mechanism splits larger ones), so a batch always
        takes at least the first request in order when it dispatches.
        """
        if not queue:
            return Decision()
        s = self.settings
        expired: list[int] = []
        order: list[int] = []
        delayed: list[int] = []
        timed = False
        for i, p in enumerate(queue):
            if p.deadline is not None:
                timed = True
                if now >= p.deadline:
                    (expired if p.reject_on_timeout else delayed).append(i)
                    continue
            order.append(i)
        if self._ordered and len(order) > 1:
            order.sort(key=lambda i: queue[i].priority)  # stable: arrival order within a level
        order.extend(delayed)  # DELAY: timed-out requests go after every other one
        if not order:
            return Decision(expired=tuple(expired))
        if s.max_batch_size <= 0 or s.isolate_requests or queue[order[0]].alone:
            return Decision(batch=(order[0],), expired=tuple(expired))
        alone = next((i for i in order if queue[i].alone), None)  # goes while the first group waits for company

        cap = max(1, min(cap, s.max_batch_size))
        lead = queue[order[0]].group
        same = [i for i in order if queue[i].group == lead]  # the first request's group; others wait their turn
        batch: list[int] = []
        rows = 0
        for i in same:
            if rows + queue[i].rows > cap:
                break
            batch.append(i)
            rows += queue[i].rows
        full = rows >= cap or len(batch) < len(same)
        oldest = min(queue[i].arrival for i in same)
        if full or self._delay <= 0 or now - oldest >= self._delay:
            return Decision(batch=tuple(batch), expired=tuple(expired))
        if s.preferred_batch_sizes:
            if rows >= s.preferred_batch_sizes[-1]:
                return Decision(batch=tuple(self._preferred_prefix(queue, batch)), expired=tuple(expired))
        elif len(same) >= s.merge_after:
            return Decision(batch=tuple(batch), expired=tuple(expired))
        if alone is not None:
            return Decision(batch=(alone,), expired=tuple(expired))
        wake_at = oldest + self._delay
        if timed:
            deadlines = [queue[i].deadline for i in order if queue[i].deadline is not None]  # every group's
            wake_at = min([wake_at, *(d for d in deadlines if d is not None and d > now)])
        return Decision(expired=tuple(expired), wake_at=wake_at)

    @staticmethod
    def expire(queue: Sequence[Pending], now: float) -> tuple[tuple[int, ...], float | None]:
        """While every instance is busy: the requests to reject for timeout now, and the next deadline."""
        expired: list[int] = []
        upcoming: float | None = None
        for i, p in enumerate(queue):
            if p.deadline is None or not p.reject_on_timeout:
                continue
            if now >= p.deadline:
                expired.append(i)
            elif upcoming is None or p.deadline < upcoming:
                upcoming = p.deadline
        return tuple(expired), upcoming

    def _preferred_prefix(self, queue: Sequence[Pending], batch: list[int]) -> list[int]:
        """The longest prefix of ``batch`` whose rows are exactly a preferred size (else all of it)."""
        preferred = set(self.settings.preferred_batch_sizes)
        rows, best = 0, len(batch)
        for n, i in enumerate(batch, start=1):
            rows += queue[i].rows
            if rows in preferred:
                best = n
        return batch[:best]
