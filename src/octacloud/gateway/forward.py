"""The gateway's forwarding core, one for every front (REST, gRPC, OpenAI's API): authorize, admit, choose a
replica, forward, retry or eject, bill.

A front only translates its wire. It reads the caller's key and the deployment from the request, hands the core
one small callable that sends the request to one replica (an ``ask``), and turns what the core answers into its
protocol's statuses:

| the core | REST | gRPC |
| --- | --- | --- |
| ``AuthError`` (:meth:`Forwarding.authorize`) | 401 | UNAUTHENTICATED |
| ``RateLimitedError`` | 429 + Retry-After | RESOURCE_EXHAUSTED + retry-after |
| :class:`NotAdmitted` ``unknown`` (:meth:`Forwarding.admit`) | 404 | NOT_FOUND |
| :class:`NotAdmitted` ``starting``, ``no replica``, ``at capacity`` | 503 + Retry-After 1 | UNAVAILABLE |
| :class:`Exhausted` (:meth:`Forwarding.forward`) | 503 + Retry-After | UNAVAILABLE + retry-after |
| :class:`TimedOut` | 504 | DEADLINE_EXCEEDED |

An ask raises :class:`Unanswered` when the replica gave no answer (no connection, a reset, another process at its
address, a gRPC UNAVAILABLE that says no ``retry-after``): the replica counts one transport failure (at the limit
it is ejected, ``routing.OutlierPolicy``) and another replica is tried, up to :data:`MAX_ATTEMPTS`. A replica's
own refusal (an error of the request's, or load shed with a ``retry-after``) is an answer, passed on as it came.
A ``TimeoutError`` is not retried (the request may be running there): the replica counts a failure and the
caller is told :class:`TimedOut`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias, TypeVar

from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.routing import DeploymentCounters, Endpoint, NotAdmitted, RouteTable
from octacloud.metering import Traffic
from octacloud.tenancy import ANONYMOUS_ADMIN, Guard, Principal
from octacloud.tenancy.guard import Headers

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Replicas tried for one request before the caller is told none answered."""

A = TypeVar("A")
Ask: TypeAlias = Callable[[Endpoint], Awaitable[A]]
"""A front's one step of the forwarding: send the request to one replica, return its answer (or raise
:class:`Unanswered`)."""


class Unanswered(Exception):
    """Raised by an ask: the replica gave no answer (the message says why); the request goes to another one."""


class Exhausted(Exception):
    """No replica answered (none ready, or every one tried failed); retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TimedOut(Exception):
    """The replica asked did not answer within the front's timeout (it counted one failure)."""


class Flight:
    """A request's slot under its deployment's in-flight bound, taken on entry (``with``: yields when the request
    started, ``time.perf_counter``) and given back on exit, adding the request's time to the deployment's latency."""

    __slots__ = ("counters", "started")

    def __init__(self, counters: DeploymentCounters) -> None:
        self.counters = counters
        self.started = 0.0

    def __enter__(self) -> float:
        self.started = time.perf_counter()
        self.counters.outstanding += 1
        return self.started

    def __exit__(self, *_: object) -> None:
        counters = self.counters
        counters.outstanding -= 1
        counters.latency_us_total += int((time.perf_counter() - self.started) * 1e6)


class Forwarding:
    """The mechanism every front shares, over the route table, the guard, the bounds and the cloud's readiness."""

    __slots__ = ("guard", "limits", "ready", "routes")

    def __init__(
        self, routes: RouteTable, guard: Guard | None, limits: GatewayLimits, ready: Callable[[], bool]
    ) -> None:
        self.routes = routes
        self.guard = guard
        """None only in tests of a front itself: then every caller is an anonymous admin who sees everything."""
        self.limits = limits
        self.ready = ready

    def authorize(self, fields: Headers) -> Principal:
        """The caller from its key (headers or metadata), one request taken from its tenant's rate: raises
        ``AuthError`` or ``RateLimitedError``."""
        guard = self.guard
        if guard is None:
            return ANONYMOUS_ADMIN
        principal = guard.authorize(fields)
        guard.admit(principal)
        return principal

    def admit(self, deployment: str, principal: Principal) -> DeploymentCounters | NotAdmitted:
        """The deployment's counters if a request of ``principal``'s for it may go on now, else why not: the cloud
        starting, a deployment the caller may not see (``unknown``, as one that is not there), no ready replica, or
        its in-flight bound reached. The caller takes the slot (:meth:`flight`) before anything awaits."""
        if not self.ready():
            return NotAdmitted("starting", "the cloud is starting; retry shortly")
        may_see = None if self.guard is None else principal.may_see
        return self.routes.admit(deployment, may_see, self.limits.max_inflight_per_replica)

    flight = Flight
    """``flight(counters)``: the request's slot under its deployment's in-flight bound, held for a ``with`` block
    (see :class:`Flight`); the class itself, so that taking one is one call."""

    @staticmethod
    def received(counters: DeploymentCounters, size: int) -> None:
        """A request of ``size`` bytes goes to the replicas."""
        counters.requests += 1
        counters.bytes_in += size

    async def forward(
        self,
        deployment: str,
        counters: DeploymentCounters,
        size: int,
        ask: Ask[A],
        timeout: float,
        hold: bool = False,
    ) -> tuple[A, Endpoint]:
        """The first answer of a replica of ``deployment`` (chosen by the route table), up to :data:`MAX_ATTEMPTS`
        replicas asked; and the replica. Each counts the request in its ``outstanding`` while it is asked, and
        (``hold``) past the answer: the caller then gives it back when it has relayed the answer (a stream).
        Raises :class:`Exhausted` or :class:`TimedOut` (``timeout`` is the ask's, for the message)."""
        counters.requests += 1  # self.received, inline: this runs for every request
        counters.bytes_in += size
        routes = self.routes
        tried: list[str] = []
        for _ in range(MAX_ATTEMPTS):
            endpoint = routes.choose(deployment, tried)
            if endpoint is None:
                break
            tried.append(endpoint.replica_id)
            endpoint.outstanding += 1
            kept = False
            try:
                answer = await ask(endpoint)
                kept = hold
            except Unanswered as exc:
                routes.failed(endpoint)
                log.warning("deployment %s: replica %s: %s", deployment, endpoint.replica_id, exc)
                continue
            except TimeoutError:
                routes.failed(endpoint)
                counters.failures += 1
                log.warning("deployment %s: replica %s: no answer within %g s", deployment, endpoint.replica_id,
                            timeout)  # fmt: skip
                raise TimedOut(f"deployment '{deployment}': no answer within {timeout:g} s") from None
            finally:
                if not kept:
                    endpoint.outstanding -= 1
            routes.succeeded(endpoint)
            return answer, endpoint
        counters.failures += 1
        why = (
            f"deployment '{deployment}': {len(tried)} replica(s) tried, none answered"
            if tried
            else f"deployment '{deployment}' has no ready replica"
        )  # formatted only when it is said
        raise Exhausted(why, routes.retry_after(deployment))

    async def fan_out(self, deployment: str, counters: DeploymentCounters, size: int, ask: Ask[A | None]) -> list[A]:
        """Every answer of the ready replicas of ``deployment``, asked at once (an ask's None: no answer)."""
        self.received(counters, size)
        answers = await asyncio.gather(*(ask(e) for e in self.routes.healthy(deployment)))
        return [a for a in answers if a is not None]

    @staticmethod
    def settle(
        counters: DeploymentCounters, usage: Traffic, size_in: int, size_out: int, *, failed: bool, billed: bool
    ) -> None:
        """Count an answer of ``size_out`` bytes (``failed``: an error), and bill it to the caller's ``usage``
        unless it was the cloud's failure rather than the replica's answer. Called before the answer leaves: a
        client that has it finds it metered."""
        counters.bytes_out += size_out
        if failed:
            counters.failures += 1
        if billed:
            usage.bill(size_in, size_out)
