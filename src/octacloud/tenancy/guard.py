"""The front ends' one call: who is this request from, and may it go now?"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from octacloud.core.errors import OctacloudError
from octacloud.tenancy.keys import AuthError, KeyStore, Principal, bearer_key
from octacloud.tenancy.limits import RateLimiter

Headers = Mapping[str, str] | Iterable[tuple[bytes, bytes]] | Iterable[tuple[str, str | bytes]]
"""A Starlette/ASGI header list (``[(b"authorization", b"Bearer ...")]``), gRPC invocation metadata
(``(("authorization", "Bearer ..."),)``) or a plain mapping."""


class RateLimitedError(OctacloudError):
    """The caller's tenant is over its request rate; retry after ``retry_after`` seconds."""

    def __init__(self, tenant: str, retry_after: int) -> None:
        super().__init__(f"tenant {tenant!r} is over its request rate; retry after {retry_after} s")
        self.retry_after = retry_after


class Guard:
    """Authentication and rate limiting for every entry point (REST, gRPC, admin API, dashboard)."""

    def __init__(self, keys: KeyStore, limiter: RateLimiter | None = None) -> None:
        self.keys = keys
        self.limiter = limiter or RateLimiter(keys.clock)

    def authorize(self, headers: Headers) -> Principal:
        """The caller's principal from its ``authorization`` header or metadata; raises :class:`AuthError` (that
        says whether the key is missing, sent without ``Bearer``, malformed, unknown, revoked or disabled)."""
        return self.keys.authenticate(bearer_key(authorization_header(headers)))

    def admit(self, principal: Principal) -> None:
        """Take one request from the tenant's rate budget; raises :class:`RateLimitedError` when it is spent."""
        wait = self.limiter.check(principal.tenant, principal.quota)
        if wait:
            raise RateLimitedError(principal.tenant, wait)


def authorization_header(headers: Headers) -> str | None:
    items = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in items:
        key = name.decode("latin-1") if isinstance(name, bytes) else name
        if key.lower() == "authorization":
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


__all__ = ["AuthError", "Guard", "Headers", "RateLimitedError", "authorization_header"]
