"""The meter: turns what the cloud holds and measures into ledger records, one closed interval at a time.

Intervals are aligned to multiples of ``interval_ms`` on the injected clock's wall time. Between closes the
meter samples (every ``tick``) the slices each replica holds and integrates milli-GPU × time, and the energy of
its share of its cards (each card's measured draw × milli-GPU / 1000 × time); at each close it
reads the cumulative counters (the gateway's traffic per tenant and deployment, each replica's execution
time and inference count) and records their change since the last close, plus storage × interval length.

Guarantees:

- an interval is written whole or not at all, with the progress mark, in one transaction; a write that fails
  is retried at the next tick with the same keys, so it is never lost while the process lives and never
  counted twice;
- an interval holds the traffic the gateway counted before its end, never after: each tick inside an interval
  marks the counters, the run loop ticks ``MARK_LEAD_MS`` before each end, and a close that runs after the
  end uses the last mark (requests counted between the mark and the end fall into the next interval; a meter
  stalled past a whole interval moves that interval's traffic to the first interval it marks again). The
  replicas' work counters are read when the interval is closed;
- storage is measured off the event loop (a thread), so walking a large model folder never stalls serving;
- after a restart the meter resumes at the later of now and the last closed interval's end: completed
  intervals are never rewritten and never double-counted. What the gateway counted in the interval that was
  open when the process died is lost with the process (its counters lived in memory); time while no meter ran
  is not billed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from octacloud.core.clock import Clock
from octacloud.metering.ledger import Ledger, Metric, UsageRecord

log = logging.getLogger("octacloud.metering")

MARK_LEAD_MS = 5
"""The run loop ticks this long before each interval's end to mark the traffic counters."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """A replica's slice right now: ``milli`` is its milli-GPU summed over its cards (8 octants = 1000), the
    same share of each of ``gpus`` (card indices on ``node``)."""

    tenant: str
    deployment: str
    replica: str
    gpu_model: str
    milli: int
    node: str = ""
    gpus: tuple[int, ...] = ()


@dataclass(slots=True)
class Traffic:
    """Cumulative gateway counters of one (calling tenant, deployment) since the gateway started: the gateway
    counts into one (:meth:`bill`), the meter reads copies of them (:meth:`copy`)."""

    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of its generation requests (the ``usage`` the replicas reported)."""
    completion_tokens: int = 0
    """Tokens generated for it."""

    def bill(self, bytes_in: int, bytes_out: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count one request that carried ``bytes_in`` to its replica and ``bytes_out`` back (and, for a generation,
        its prompt's and its completion's tokens)."""
        self.requests += 1
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def copy(self) -> Traffic:
        return Traffic(self.requests, self.bytes_in, self.bytes_out, self.prompt_tokens, self.completion_tokens)


@dataclass(frozen=True, slots=True)
class Work:
    """Cumulative counters a replica reports (they restart from 0 when the replica process restarts)."""

    tenant: str
    deployment: str
    gpu_model: str
    exec_us: int
    inferences: int


@dataclass(frozen=True, slots=True)
class Stored:
    tenant: str
    deployment: str
    bytes: int


class UsageSource(Protocol):
    """What the meter reads. ``allocations`` and ``storage`` are the state now; ``traffic`` and ``work`` are
    monotonically non-decreasing counters, returned as copies the meter may keep (``work`` may restart from zero
    with its replica and may omit a replica it could not reach). None of them may raise; ``allocations``,
    ``traffic`` and ``work`` run on the event loop and must not block it; ``storage`` runs in a worker thread (it
    may walk folders) and must bound its own time."""

    def allocations(self) -> list[Allocation]: ...

    def traffic(self) -> Mapping[tuple[str, str], Traffic]: ...

    def work(self) -> Awaitable[Mapping[str, Work]]: ...

    def storage(self) -> list[Stored]: ...

    def gpu_use(self) -> Mapping[str, int]:
        """Replica → milli-GPU it is measured to use right now (NVML); replicas not measured are absent."""
        ...

    def card_power(self) -> Mapping[tuple[str, int], float]:
        """(node, card index) → the watts the card is measured to draw right now (NVML); cards whose draw is not
        measured (CPU "cards", a stale sample) are absent."""
        ...


class Meter:
    def __init__(
        self,
        ledger: Ledger,
        source: UsageSource,
        clock: Clock,
        interval_s: float = 10.0,
        name: str = "meter",
    ) -> None:
        if interval_s < 0.1:
            raise ValueError(f"meter interval must be at least 0.1 s, got {interval_s}")
        self.ledger = ledger
        self.source = source
        self.clock = clock
        self.interval_ms = int(interval_s * 1000)
        self.name = name
        now = self._now()
        closed = ledger.closed_until_ms(name)
        self.start_ms = now if closed is None else max(now, closed)
        self._sampled_ms = self.start_ms
        self._alloc: dict[tuple[str, str, str, str], int] = {}
        self._used: dict[tuple[str, str, str, str], int] = {}
        self._energy: dict[tuple[str, str, str, str], float] = {}  # millijoules, rounded when the interval closes
        self._traffic: dict[tuple[str, str], Traffic] = dict(source.traffic())
        self._mark: tuple[int, dict[tuple[str, str], Traffic]] | None = None  # (when, counters) inside the interval
        self._work: dict[str, Work] = {}  # the replicas' counters at the last close (or at prime())
        self.closed = 0

    async def prime(self) -> None:
        """Take the replicas' counters now as the baseline: work they did before this meter started (replicas
        adopted after a restart) was either recorded by the previous meter or is not billable by this one."""
        self._work = dict(await self.source.work())

    def _now(self) -> int:
        return int(self.clock.time() * 1000)

    @property
    def end_ms(self) -> int:
        return (self.start_ms // self.interval_ms + 1) * self.interval_ms

    def sample(self) -> None:
        """Integrate the slices held since the last sample (they are taken to have held since then)."""
        self._integrate(min(self._now(), self.end_ms))

    def _integrate(self, until_ms: int) -> None:
        dt = until_ms - self._sampled_ms
        if dt <= 0:
            return
        used = self.source.gpu_use()
        power = self.source.card_power()
        for a in self.source.allocations():
            key = (a.tenant, a.deployment, a.replica, a.gpu_model)
            self._alloc[key] = self._alloc.get(key, 0) + a.milli * dt
            if a.replica in used:  # never more than the slice it holds
                self._used[key] = self._used.get(key, 0) + min(used[a.replica], a.milli) * dt
            draws = [w for g in a.gpus if (w := power.get((a.node, g))) is not None and 0 <= w < math.inf]
            if draws:  # its share of each measured card's draw (a reading that is no wattage counts nothing): W×ms=mJ
                self._energy[key] = self._energy.get(key, 0.0) + sum(draws) * a.milli / len(a.gpus) / 1000 * dt
        self._sampled_ms = until_ms

    async def tick(self) -> int:
        """Mark the traffic counters (when inside the open interval), sample, and close every interval that has
        ended. Returns how many intervals were closed."""
        now = self._now()
        if now < self.end_ms:
            self._mark = (now, dict(self.source.traffic()))
        closed = 0
        while self._now() >= self.end_ms:
            if not await self.close(self.end_ms):
                break
            closed += 1
        self.sample()
        return closed

    async def close(self, end_ms: int, *, final: bool = False) -> bool:
        """Close the open interval at ``end_ms`` (an aligned end, or now on shutdown: ``final``). False if the
        ledger write failed: the interval stays open and is written, with the same keys, by a later call."""
        self._integrate(end_ms)
        start, length = self.start_ms, end_ms - self.start_ms
        if length <= 0:
            return True
        if final or end_ms >= self._now():  # closing at now (shutdown): the counters now are the interval's
            traffic = dict(self.source.traffic())
        elif self._mark is not None and start <= self._mark[0] <= end_ms:
            traffic = self._mark[1]
        else:  # no mark inside this past interval: its traffic goes to the next one that has a mark
            traffic = self._traffic
        work = dict(await self.source.work())
        records = self._held_records(start, length)
        records += self._traffic_records(traffic, start, length)
        records += self._work_records(work, start, length)
        for s in await asyncio.to_thread(self.source.storage):
            if s.bytes > 0:
                records.append(UsageRecord(s.tenant, s.deployment, "", Metric.STORAGE, start, length, s.bytes * length))
        try:
            await asyncio.to_thread(self.ledger.append, records, self.name, end_ms)
        except Exception:  # the database is down or locked: keep the interval, retry next tick
            log.exception("usage interval starting at %d ms not written; will retry", start)
            return False
        self._traffic = traffic
        held = {a.replica for a in self.source.allocations()}
        self._work = {r: w for r, w in {**self._work, **work}.items() if r in held or r in work}
        self._alloc = {}
        self._used = {}
        self._energy = {}
        self.start_ms = self._sampled_ms = end_ms
        self.closed += 1
        return True

    def _held_records(self, start: int, length: int) -> list[UsageRecord]:
        """The interval's allocation, GPU use and energy integrated so far, one record per replica and model."""
        records = [
            UsageRecord(t, d, r, Metric.ALLOC, start, length, q, model) for (t, d, r, model), q in self._alloc.items()
        ]
        records += [
            UsageRecord(t, d, r, Metric.GPU_USED, start, length, q, model)
            for (t, d, r, model), q in self._used.items()
            if q > 0
        ]
        records += [
            UsageRecord(t, d, r, Metric.ENERGY, start, length, round(q), model)
            for (t, d, r, model), q in self._energy.items()
            if round(q) > 0
        ]
        return records

    def _traffic_records(
        self, traffic: Mapping[tuple[str, str], Traffic], start: int, length: int
    ) -> list[UsageRecord]:
        """Each deployment's requests, bytes and tokens since the last written interval (counters ``traffic``)."""
        records: list[UsageRecord] = []
        for (tenant, deployment), now in traffic.items():
            was = self._traffic.get((tenant, deployment), Traffic())
            for metric, q in (
                (Metric.REQUESTS, now.requests - was.requests),
                (Metric.BYTES_IN, now.bytes_in - was.bytes_in),
                (Metric.BYTES_OUT, now.bytes_out - was.bytes_out),
                (Metric.PROMPT_TOKENS, now.prompt_tokens - was.prompt_tokens),
                (Metric.COMPLETION_TOKENS, now.completion_tokens - was.completion_tokens),
            ):
                if q > 0:
                    records.append(UsageRecord(tenant, deployment, "", metric, start, length, q))
        return records

    def _work_records(self, work: Mapping[str, Work], start: int, length: int) -> list[UsageRecord]:
        """Each replica's execution time and inferences since the last written interval (a restarted replica's
        counters, smaller than before, count from zero)."""
        records: list[UsageRecord] = []
        for replica, w in work.items():
            base = self._work.get(replica)
            if base is None or w.exec_us < base.exec_us or w.inferences < base.inferences:
                exec_us, inferences = w.exec_us, w.inferences  # new since the last close, or restarted
            else:
                exec_us, inferences = w.exec_us - base.exec_us, w.inferences - base.inferences
            for metric, q in ((Metric.EXEC, exec_us), (Metric.INFERENCES, inferences)):
                if q > 0:
                    records.append(UsageRecord(w.tenant, w.deployment, replica, metric, start, length, q, w.gpu_model))
        return records

    async def flush(self) -> bool:
        """On shutdown: close the open interval at now, so nothing measured so far is lost."""
        # ``final``: the counters as they are now belong to this last interval even if the clock has moved on by
        # the time close() compares it with ``end_ms`` (no later interval will ever take them)
        return await self.close(max(self._now(), self.start_ms), final=True)

    def _wait_s(self, tick_s: float) -> float:
        """Until the next tick: ``tick_s``, or sooner to mark just before the interval's end and close just
        after it."""
        now = self._now()
        to_mark, to_end = self.end_ms - MARK_LEAD_MS - now, self.end_ms - now
        soonest = to_mark if to_mark > 0 else to_end if to_end > 0 else 0
        return min(tick_s, soonest / 1000) if soonest > 0 else tick_s

    async def run(self, stop: asyncio.Event, tick_s: float = 1.0, on_tick: Callable[[], None] | None = None) -> None:
        tick_s = min(tick_s, self.interval_ms / 1000 / 4)
        await self.prime()
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # a meter bug must not take the cloud down; it is logged and retried
                log.exception("meter tick failed")
            if on_tick is not None:
                on_tick()
            try:
                await asyncio.wait_for(stop.wait(), self._wait_s(tick_s))
            except TimeoutError:
                pass
        await self.flush()
