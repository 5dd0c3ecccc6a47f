"""What each replica measured: its process's CPU time and memory (``/proc``), its Triton metrics and statistics.

On a machine without GPUs these are the honest equivalents of GPU telemetry: how long a replica's model spent
executing batches (from its statistics' per-batch-size compute durations), how much CPU its process burned, and
how much memory it holds. They are exported under octacloud's own names, never under DCGM's.

:class:`ReplicaScraper` fetches ``/metrics`` (Triton's names; parsed with prometheus_client's official parser,
so a replica whose text does not parse is reported) and ``/v2/models/<name>/stats`` (batch-size histogram and
execution time) from each ready replica concurrently, each with a short timeout; a replica that does not answer
is simply missing from that sample.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("octacloud.observability.replicas")


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A replica as monitoring sees it (supplied by the cloud from its state store)."""

    id: str
    deployment: str
    tenant: str
    state: str
    octants: int
    """Octants per replica of its deployment (the shape of a pending request)."""
    node: str = ""
    gpus: tuple[int, ...] = ()
    milli_per_gpu: int = 0
    pid: int | None = None
    """The local process, when the replica runs on this host."""
    host: str = "127.0.0.1"
    http_port: int | None = None
    metrics_port: int | None = None
    restarts: int = 0
    message: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


ReplicaSource = Callable[[], Sequence[ReplicaInfo]]


@dataclass(frozen=True, slots=True)
class ProcessSample:
    cpu_seconds: float
    """User plus system CPU time of the process so far."""
    rss_bytes: int


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

ProcessReader = Callable[[int], ProcessSample | None]
"""PID → its CPU time and resident memory, or None when the process is gone or unreadable."""


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcessSample | None:
    """CPU time and resident memory of ``pid`` and every process under it (Linux): a replica's models may
    compute in child processes (``compute: "process"``). CPU time counts the children it has reaped as well,
    so a child that died and was replaced takes nothing back."""
    own = _read_one(pid, proc)
    if own is None:
        return None
    cpu, rss = own
    for child in _descendants(pid, proc):
        one = _read_one(child, proc)
        if one is not None:
            cpu += one[0]
            rss += one[1]
    return ProcessSample(cpu / _TICKS, rss)


def _read_one(pid: int, proc: Path) -> tuple[int, int] | None:
    """(clock ticks of CPU of the process and its reaped children, resident bytes), None when gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        statm = (proc / str(pid) / "statm").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # fields after "(comm)"; the state is fields[0] (field 3)
    if len(fields) < 15 or fields[0] == "Z":
        return None
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime: fields 14 to 17 of proc(5)
    return ticks, int(statm.split()[1]) * _PAGE


def _descendants(pid: int, proc: Path) -> list[int]:
    """Every live process under ``pid`` (``/proc/PID/task/*/children``; none where the kernel lacks it)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list((proc / str(parent) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out.extend(children)
            todo.extend(children)
    return out


@dataclass(slots=True)
class ReplicaServing:
    """One scrape of a replica: its Triton metric families and its statistics summed over model versions."""

    families: list[Metric] = field(default_factory=list)
    batch_executions: dict[int, int] = field(default_factory=dict)
    """Batch size → number of executions of that size."""
    execution_ns: int = 0
    """Cumulative time spent executing batches (input + infer + output, once per batch)."""
    inference_count: int = 0
    execution_count: int = 0


def parse_statistics(payload: Any) -> ReplicaServing:
    """A Triton statistics response (``{"model_stats": [...]}``) summed over its versions."""
    out = ReplicaServing()
    for version in payload.get("model_stats", []):
        out.inference_count += int(version.get("inference_count", 0))
        out.execution_count += int(version.get("execution_count", 0))
        for batch in version.get("batch_stats", []):
            size = int(batch["batch_size"])
            executions = int(batch["compute_infer"]["count"])
            out.batch_executions[size] = out.batch_executions.get(size, 0) + executions
            out.execution_ns += sum(int(batch[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output"))
    return out


T = TypeVar("T")

FAN_OUT = 32
"""How many requests to replicas one scrape keeps in flight at once (see :func:`bounded_gather`)."""


async def bounded_gather(awaitables: Iterable[Awaitable[T]], limit: int = FAN_OUT) -> list[T | BaseException]:
    """``asyncio.gather(..., return_exceptions=True)`` with at most ``limit`` awaited at once, results in order.

    One HTTP client asked for thousands of replicas at once costs the square of their number: httpx's pool looks
    through every waiting request each time a connection frees up. Queued here, a fleet-wide scrape costs its size.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    gate = asyncio.Semaphore(limit)

    async def one(a: Awaitable[T]) -> T:
        async with gate:
            return await a

    waiting = list(awaitables)
    try:
        return await asyncio.gather(*(one(a) for a in waiting), return_exceptions=True)
    finally:  # cancelled: what never started never will
        for a in waiting:
            if inspect.iscoroutine(a) and inspect.getcoroutinestate(a) == inspect.CORO_CREATED:
                a.close()


class Scraper(Protocol):
    """Fetches what ready replicas measured. ``scrape`` returns within its timeout and never raises: a replica
    that does not answer is missing from the result."""

    async def scrape(self, replicas: Sequence[ReplicaInfo]) -> dict[str, ReplicaServing]: ...

    async def close(self) -> None: ...


class ReplicaScraper:
    """Scrapes ready replicas concurrently. Call :meth:`close` when done (it owns an HTTP client)."""

    def __init__(
        self,
        timeout_s: float = 0.5,
        client: httpx.AsyncClient | None = None,
        headers: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
        naming: str | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.naming = naming
        """The header that names the replica each scrape is meant for (the cloud's ``x-octacloud-replica``): a
        process that took a dead replica's port then answers 421 instead of its own figures."""
        self._scheme = "https" if tls is not None else "http"
        """Internal TLS: ``tls`` trusts the cloud CA only and presents the cloud's client certificate."""
        self._client = client or httpx.AsyncClient(
            timeout=timeout_s, trust_env=False, headers=headers, verify=tls if tls is not None else True
        )

    async def scrape(self, replicas: Sequence[ReplicaInfo]) -> dict[str, ReplicaServing]:
        ready = [r for r in replicas if r.ready and r.http_port]
        results = await bounded_gather(self._one(r) for r in ready)  # (a fleet's worth at once is quadratic)
        return {r.id: s for r, s in zip(ready, results, strict=True) if isinstance(s, ReplicaServing)}

    async def _one(self, r: ReplicaInfo) -> ReplicaServing | None:
        named = {self.naming: r.id} if self.naming else None
        try:
            stats = await self._client.get(
                f"{self._scheme}://{r.host}:{r.http_port}/v2/models/{r.deployment}/stats", headers=named
            )
            stats.raise_for_status()
            out = parse_statistics(stats.json())
            if r.metrics_port:
                text = await self._client.get(f"{self._scheme}://{r.host}:{r.metrics_port}/metrics", headers=named)
                text.raise_for_status()
                out.families = list(text_string_to_metric_families(text.text))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("replica %s: scrape failed: %s", r.id, exc)
            return None
        return out

    async def close(self) -> None:
        await self._client.aclose()
