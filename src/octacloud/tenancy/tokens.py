"""A tenant's generation limits: tokens per minute, and generations in flight at once.

Tokens are known only when a generation ends, so the budget works as the field's gateways do (Azure OpenAI's
tokens-per-minute, vLLM's router): a request is admitted while the tenant's bucket is not in debt, and takes
its estimate at once (its prompt's bytes / 4 plus ``n × max_tokens``), so that requests started together cannot
all spend the same budget; when it ends the estimate is replaced by the tokens its ``usage`` reports. The bucket
holds one minute of the rate and refills continuously on the injected clock. A tenant in debt waits until the
refill pays it off (``Retry-After``).

Every generation in flight counts against ``max_streams``, whether it streams or not (a generation holds an
engine slot either way).

One process holds a tenant's limits: the gateway's, or with gateway workers the main process's, which the workers
ask (``gateway/generations.py``), so that N workers give a tenant its limits once, not N times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from octacloud.core.clock import Clock, SystemClock
from octacloud.core.errors import OctacloudError
from octacloud.tenancy.keys import Quota


class OverLimitError(OctacloudError):
    """The tenant is over its token rate or at its concurrent streams; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True)
class _Budget:
    per_minute: int
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now


@dataclass(frozen=True, slots=True)
class Hold:
    """What :meth:`GenerationLimits.admit` took for one request (given back by :meth:`GenerationLimits.settle`)."""

    tenant: str
    tokens: int
    budgeted: bool
    ticket: int = 0
    """Where another process holds it (a gateway worker's admission at the main process): its id there."""


@dataclass(slots=True)
class GenerationLimits:
    """Per-tenant token budgets and stream counts (see the module docstring)."""

    clock: Clock | None = None
    _budgets: dict[str, _Budget] = field(default_factory=dict)
    streams: dict[str, int] = field(default_factory=dict)
    """Tenant → generations in flight now."""

    def _now(self) -> float:
        return (self.clock or SystemClock()).monotonic()

    async def ask(self, tenant: str, quota: Quota, estimate: int) -> Hold:
        """:meth:`admit`, as the gateway's front asks it (a gateway worker asks the main process instead)."""
        return self.admit(tenant, quota, estimate)

    def admit(self, tenant: str, quota: Quota, estimate: int) -> Hold:
        """Admit one generation estimated at ``estimate`` tokens, or raise :class:`OverLimitError`."""
        if quota.max_streams is not None and self.streams.get(tenant, 0) >= quota.max_streams:
            raise OverLimitError(
                f"tenant {tenant!r} has {quota.max_streams} generation(s) in flight, its limit; retry when one ends",
                1,
            )
        budgeted = quota.tokens_per_minute is not None
        if quota.tokens_per_minute is not None:
            now = self._now()
            budget = self._budgets.get(tenant)
            if budget is None or budget.per_minute != quota.tokens_per_minute:
                budget = self._budgets[tenant] = _Budget(quota.tokens_per_minute, float(quota.tokens_per_minute), now)
            budget.refill(now)
            if budget.level <= 0:
                wait = (1.0 - budget.level) * 60.0 / budget.per_minute
                raise OverLimitError(
                    f"tenant {tenant!r} is over its {quota.tokens_per_minute} tokens per minute; "
                    f"retry after {math.ceil(wait)} s",
                    max(1, math.ceil(wait)),
                )
            budget.level -= estimate
        self.streams[tenant] = self.streams.get(tenant, 0) + 1
        return Hold(tenant, estimate, budgeted)

    def settle(self, hold: Hold, used: int) -> None:
        """The generation ended having used ``used`` tokens: its estimate is replaced by that."""
        left = self.streams.get(hold.tenant, 0) - 1
        if left > 0:
            self.streams[hold.tenant] = left
        else:
            self.streams.pop(hold.tenant, None)
        budget = self._budgets.get(hold.tenant)
        if hold.budgeted and budget is not None:
            budget.refill(self._now())
            budget.level = min(float(budget.per_minute), budget.level + hold.tokens - used)

    def level(self, tenant: str) -> float | None:
        """Tokens left in the tenant's budget now (None: no budget)."""
        budget = self._budgets.get(tenant)
        if budget is None:
            return None
        budget.refill(self._now())
        return budget.level
