"""Tenants, API keys, roles, quotas, rate limits and priority classes (see docs/tenants.md).

:class:`Guard` is what the front ends call: ``guard.authorize(headers)`` returns the caller's
:class:`Principal` or raises :class:`AuthError` (its message is safe to show: it never holds key text).
"""

from __future__ import annotations

from octacloud.tenancy.guard import Guard, RateLimitedError
from octacloud.tenancy.keys import (
    ADMIN_TENANT,
    ANONYMOUS_ADMIN,
    AuthError,
    KeyInfo,
    KeyStore,
    Principal,
    Quota,
    Role,
    Tenant,
    bearer,
    bearer_key,
    default_burst,
    server_secret,
)
from octacloud.tenancy.limits import Holding, QuotaExceededError, RateLimiter, TenantQuotas, check_quota
from octacloud.tenancy.priority import Grant, PriorityClass, PriorityClasses, PriorityNotGrantedError

__all__ = [
    "ADMIN_TENANT",
    "ANONYMOUS_ADMIN",
    "AuthError",
    "Grant",
    "Guard",
    "Holding",
    "KeyInfo",
    "KeyStore",
    "Principal",
    "PriorityClass",
    "PriorityClasses",
    "PriorityNotGrantedError",
    "Quota",
    "QuotaExceededError",
    "RateLimitedError",
    "RateLimiter",
    "Role",
    "Tenant",
    "TenantQuotas",
    "bearer",
    "bearer_key",
    "check_quota",
    "default_burst",
    "server_secret",
]
