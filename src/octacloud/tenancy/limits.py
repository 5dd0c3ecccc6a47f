"""Request-rate limits (a token bucket per tenant, on the injected clock) and deploy-time quotas."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from octacloud.core.clock import Clock
from octacloud.core.errors import OctacloudError
from octacloud.tenancy.keys import KeyStore, Quota


class QuotaExceededError(OctacloudError):
    """A deploy or scale would take a tenant past its quota; nothing was changed."""


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; a request takes one token."""

    rate: float
    burst: int
    tokens: float
    at: float

    def refill(self, now: float) -> None:
        """Add the tokens earned since the last refill, up to ``burst``."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 when granted, else the seconds until one will be available."""
        self.refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One token bucket per tenant. Tenants without a rate limit are never refused."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, tenant: str, quota: Quota) -> int:
        """0 when the request may go; otherwise whole seconds to wait (the ``Retry-After`` value, >= 1)."""
        if quota.requests_per_s is None:
            return 0
        now = self.clock.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != quota.requests_per_s or bucket.burst != quota.burst:
            bucket = self._buckets[tenant] = TokenBucket(quota.requests_per_s, quota.burst, float(quota.burst), now)
        wait = bucket.take(now)
        return 0 if wait == 0.0 else max(1, math.ceil(wait))


@dataclass(frozen=True, slots=True)
class Holding:
    """What one existing deployment of a tenant may hold at most."""

    name: str
    octants: int
    max_replicas: int


def check_quota(tenant: str, quota: Quota, existing: Iterable[Holding], new: Holding) -> None:
    """Raise :class:`QuotaExceededError` when adding (or replacing) ``new`` takes ``tenant`` past its quota.

    Octants count each deployment at its maximum replica count, so the autoscaler and ``scale`` (bounded by
    ``max_replicas``) can never take a tenant past its quota later.
    """
    others = [h for h in existing if h.name != new.name]
    if quota.deployments is not None and len(others) + 1 > quota.deployments:
        raise QuotaExceededError(
            f"tenant {tenant!r} may have {quota.deployments} deployment(s) and has {len(others)}; "
            "undeploy one or ask an admin to raise the quota"
        )
    if quota.octants is not None:
        held = sum(h.octants * h.max_replicas for h in others)
        wanted = new.octants * new.max_replicas
        if held + wanted > quota.octants:
            raise QuotaExceededError(
                f"tenant {tenant!r} may hold {quota.octants} octant(s); its other deployments may hold {held} and "
                f"{new.name!r} asks for {new.octants} × {new.max_replicas} replica(s) = {wanted}; "
                "lower --octants or --max-replicas, or ask an admin to raise the quota"
            )


class TenantQuotas:
    """Deploy admission by the quotas of the key store's tenants: what the controller asks before it stores a
    deployment, for every caller. A tenant the store does not know is refused (404)."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    def admit(self, tenant: str, new: Holding, others: list[Holding]) -> None:
        check_quota(tenant, self.keys.tenant(tenant).quota, others, new)
