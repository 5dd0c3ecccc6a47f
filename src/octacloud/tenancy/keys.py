"""Tenants and API keys: who may call the cloud, with which role, and how a key is checked.

A key looks like ``oc_<id>_<secret>``: ``id`` (12 hex digits) names the row, ``secret`` is 32 random bytes
(``secrets.token_urlsafe``). Only ``HMAC-SHA256(server secret, secret)`` is stored. A keyed fast hash rather
than scrypt: the secret has 256 bits of entropy, so a slow hash adds nothing against guessing, while every
request pays for the check; and the server secret lives in a 0600 file beside the database, not in it, so a
copy of the database alone cannot verify a guess. Digests are compared with :func:`hmac.compare_digest`.

Verified keys are cached for ``cache_s`` seconds of the injected clock, so the database is read once per key
per few seconds rather than per request; revoking a key or disabling a tenant through this object drops its
cache entries at once (another process sharing the database sees the change within ``cache_s``).

Key text is never logged and never part of an error message: errors name the key's id at most.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Boolean, Float, Integer, String, inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from octacloud.core import fields
from octacloud.core.clock import Clock
from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError
from octacloud.core.fields import TENANT_NAME, TENANT_RULE

ADMIN_TENANT = "admin"
_KEY = re.compile(r"oc_([0-9a-f]{12})_([A-Za-z0-9_-]{20,128})")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9._~+-]{0,19}")
MAX_QUOTA_OCTANTS = 1_000_000
MAX_QUOTA_DEPLOYMENTS = 100_000
MAX_RATE = 1e6
"""The highest request rate a quota may name (requests per second)."""
MAX_BURST = 1_000_000
MAX_TOKENS_PER_MINUTE = 10**12
MAX_STREAMS = 1_000_000


class Role(enum.Enum):
    ADMIN = "admin"  # the fleet, every deployment, every tenant's usage
    TENANT = "tenant"  # its own deployments and usage


class AuthError(OctacloudError):
    """A request without a usable key. The message is safe to return to the caller (no key text)."""


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits. ``None`` means unlimited."""

    octants: int | None = None
    """Octants all its deployments may hold at their maximum replica count."""
    deployments: int | None = None
    requests_per_s: float | None = None
    """Sustained request rate per tenant (token bucket); bursts up to ``burst`` requests."""
    burst: int = 50
    """Requests admitted at once above the rate (the bucket's size); see :func:`default_burst`."""
    tokens_per_minute: int | None = None
    """Prompt and completion tokens per minute over its generation requests (``tenancy/tokens.py``)."""
    max_streams: int | None = None
    """Generation requests it may have in flight at once."""


def default_burst(requests_per_s: float | None) -> int:
    """The burst of a rate given without one: one second's worth of requests, at least 1 (a tenant limited to
    2 requests/s may send 2 at once, not 50). Without a rate there is no bucket; the stored value is 50."""
    return 50 if requests_per_s is None else max(1, math.ceil(requests_per_s))


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    quota: Quota
    disabled: bool = False
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    tenant: str
    role: Role
    created_at: float
    revoked: bool = False
    note: str = ""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the verified key's tenant and role."""

    tenant: str
    role: Role
    key_id: str
    quota: Quota = Quota()

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def may_see(self, owner: str, published: bool = False) -> bool:
        """Whether this caller may use (infer on, read) a deployment owned by ``owner``."""
        return self.is_admin or owner == self.tenant or published

    def may_manage(self, owner: str) -> bool:
        """Whether this caller may change (scale, undeploy) or read the usage of ``owner``'s deployment."""
        return self.is_admin or owner == self.tenant


ANONYMOUS_ADMIN = Principal(ADMIN_TENANT, Role.ADMIN, "")
"""The caller of front ends built without a :class:`Guard` (tests of the proxies and controller alone)."""


class _Base(DeclarativeBase):
    pass


class _TenantRow(_Base):
    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    quota_octants: Mapped[int | None] = mapped_column(Integer, nullable=True)
    quota_deployments: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requests_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    burst: Mapped[int] = mapped_column(Integer, default=50)
    created_at: Mapped[float] = mapped_column(Float)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_streams: Mapped[int | None] = mapped_column(Integer, nullable=True)


class _KeyRow(_Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(12), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(32), index=True)
    role: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    note: Mapped[str] = mapped_column(String(200), default="")


def server_secret(path: Path) -> bytes:
    """The HMAC secret, created (mode 0600) on first use."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    data = path.read_bytes()
    if len(data) < 32:
        raise InvalidSpecError(f"server secret {path} is shorter than 32 bytes; remove it only if no keys exist")
    return data


@dataclass(slots=True)
class _Cached:
    digest: bytes
    principal: Principal
    until: float


class KeyStore:
    """Tenants and keys in the state database; verifies keys for the gateway and admin API."""

    def __init__(self, engine: Engine, secret: bytes, clock: Clock, cache_s: float = 5.0) -> None:
        self.engine = engine
        self._secret = secret
        self.clock = clock
        self.cache_s = cache_s
        _Base.metadata.create_all(engine)
        _add_missing_columns(engine)
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._cache: dict[str, _Cached] = {}
        self.listeners: list[Callable[[str | None, str | None], None]] = []
        """Called with (key id, None) after a key is revoked, (None, tenant) after a tenant is disabled, enabled or
        its quota changed: e.g. to make other processes that cache verifications :meth:`forget` them."""

    def forget(self, key_id: str | None = None, tenant: str | None = None) -> None:
        """Drop cached verifications of ``key_id`` and of every key of ``tenant`` (the next use reads the store)."""
        if key_id is not None:
            self._cache.pop(key_id, None)
        if tenant is not None:
            self._cache = {k: c for k, c in self._cache.items() if c.principal.tenant != tenant}

    def _changed(self, key_id: str | None, tenant: str | None) -> None:
        self.forget(key_id, tenant)
        for listener in self.listeners:
            listener(key_id, tenant)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    def _digest(self, secret: str) -> bytes:
        return hmac.new(self._secret, secret.encode(), hashlib.sha256).digest()

    # ---- tenants -----------------------------------------------------------------------------------------

    def create_tenant(self, name: str, quota: Quota = Quota()) -> Tenant:
        fields.name(name, "tenant name", TENANT_NAME, TENANT_RULE)
        check_quota_fields(quota)
        with self._tx() as s:
            if s.get(_TenantRow, name) is not None:
                raise InvalidSpecError(f"tenant {name!r} already exists")
            row = _TenantRow(
                name=name,
                disabled=False,
                quota_octants=quota.octants,
                quota_deployments=quota.deployments,
                requests_per_s=quota.requests_per_s,
                burst=quota.burst,
                tokens_per_minute=quota.tokens_per_minute,
                max_streams=quota.max_streams,
                created_at=self.clock.time(),
            )
            s.add(row)
            return _tenant(row)

    def tenant(self, name: str) -> Tenant:
        with self._tx() as s:
            row = s.get(_TenantRow, name)
            if row is None:
                raise NotFoundError(f"no tenant named {name!r}")
            return _tenant(row)

    def tenants(self) -> list[Tenant]:
        with self._tx() as s:
            return [_tenant(r) for r in s.scalars(select(_TenantRow).order_by(_TenantRow.name))]

    def set_disabled(self, name: str, disabled: bool = True) -> Tenant:
        if name == ADMIN_TENANT and disabled:
            raise InvalidSpecError("the admin tenant cannot be disabled (revoke its keys instead)")
        with self._tx() as s:
            row = s.get(_TenantRow, name)
            if row is None:
                raise NotFoundError(f"no tenant named {name!r}")
            row.disabled = disabled
            tenant = _tenant(row)
        self._changed(None, name)
        return tenant

    def set_quota(self, name: str, quota: Quota) -> Tenant:
        """Replace a tenant's quota. Deployments it already has stay (a lower quota refuses the next deploy);
        its keys see the new quota at once here, within the cache time elsewhere."""
        check_quota_fields(quota)
        with self._tx() as s:
            row = s.get(_TenantRow, name)
            if row is None:
                raise NotFoundError(f"no tenant named {name!r}")
            row.quota_octants, row.quota_deployments = quota.octants, quota.deployments
            row.requests_per_s, row.burst = quota.requests_per_s, quota.burst
            row.tokens_per_minute, row.max_streams = quota.tokens_per_minute, quota.max_streams
            tenant = _tenant(row)
        self._changed(None, name)
        return tenant

    # ---- keys --------------------------------------------------------------------------------------------

    def create_key(self, tenant: str, role: Role = Role.TENANT, note: str = "") -> tuple[KeyInfo, str]:
        """A new key for ``tenant``: its info and the key text, which is shown once and never stored."""
        if role is Role.ADMIN and tenant != ADMIN_TENANT:
            raise InvalidSpecError(f"admin keys belong to the {ADMIN_TENANT!r} tenant, not {tenant!r}")
        secret = secrets.token_urlsafe(32)
        with self._tx() as s:
            if s.get(_TenantRow, tenant) is None:
                raise NotFoundError(f"no tenant named {tenant!r} (create it first: octacloud tenant create)")
            key_id = secrets.token_hex(6)
            while s.get(_KeyRow, key_id) is not None:
                key_id = secrets.token_hex(6)
            row = _KeyRow(
                id=key_id,
                tenant=tenant,
                role=role.value,
                digest=self._digest(secret).hex(),
                created_at=self.clock.time(),
                revoked=False,
                note=note[:200],
            )
            s.add(row)
            info = _key(row)
        return info, f"oc_{key_id}_{secret}"

    def revoke_key(self, key_id: str) -> KeyInfo:
        with self._tx() as s:
            row = s.get(_KeyRow, key_id)
            if row is None:
                raise NotFoundError(f"no key with id {key_id!r}")
            row.revoked = True
            info = _key(row)
        self._changed(key_id, None)
        return info

    def keys(self, tenant: str | None = None) -> list[KeyInfo]:
        with self._tx() as s:
            q = select(_KeyRow).order_by(_KeyRow.created_at)
            if tenant is not None:
                q = q.where(_KeyRow.tenant == tenant)
            return [_key(r) for r in s.scalars(q)]

    def ensure_admin(self) -> str | None:
        """Create the admin tenant and, if it has no live key, an admin key: returns the new key text or None."""
        try:
            self.tenant(ADMIN_TENANT)
        except NotFoundError:
            self.create_tenant(ADMIN_TENANT)
        if any(not k.revoked and k.role is Role.ADMIN for k in self.keys(ADMIN_TENANT)):
            return None
        return self.create_key(ADMIN_TENANT, Role.ADMIN, note="bootstrap")[1]

    # ---- verification ------------------------------------------------------------------------------------

    def authenticate(self, key: str | None) -> Principal:
        """The principal of a valid key; raises :class:`AuthError` (no key text in it) otherwise."""
        if not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>' (gRPC: 'authorization' metadata)")
        m = _KEY.fullmatch(key)
        if m is None:
            raise AuthError("malformed API key: expected oc_<id>_<secret>")
        key_id, secret = m.group(1), m.group(2)
        digest = self._digest(secret)
        now = self.clock.monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and cached.until > now:
            if hmac.compare_digest(cached.digest, digest):
                return cached.principal
            raise AuthError(f"invalid API key (id {key_id})")
        with self._tx() as s:
            row = s.get(_KeyRow, key_id)
            tenant = s.get(_TenantRow, row.tenant) if row is not None else None
            if row is None or tenant is None or not hmac.compare_digest(bytes.fromhex(row.digest), digest):
                raise AuthError(f"invalid API key (id {key_id})")
            if row.revoked:
                raise AuthError(f"API key {key_id} has been revoked")
            if tenant.disabled:
                raise AuthError(f"tenant {tenant.name!r} is disabled")
            principal = Principal(row.tenant, Role(row.role), key_id, _tenant(tenant).quota)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_id] = _Cached(digest, principal, now + self.cache_s)
        return principal


def bearer(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` header value (None when absent or another scheme)."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization`` header value: None when there is no header (or it is blank), the key when
    it says ``Bearer <key>``; raises :class:`AuthError` for any other value, saying what is wrong with it without
    repeating it (it may be a key sent without its scheme)."""
    if authorization is None or not authorization.strip():
        return None
    key = bearer(authorization)
    if key is not None:
        return key
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        raise AuthError("the Authorization header says 'Bearer' but holds no key: send 'Authorization: Bearer <key>'")
    if not rest.strip() and (scheme.startswith("oc_") or _KEY.fullmatch(scheme)):
        raise AuthError("the Authorization header holds a key without its scheme: send 'Authorization: Bearer <key>'")
    named = f"the {scheme!r} scheme" if _SCHEME.fullmatch(scheme) and rest.strip() else "no known scheme"
    raise AuthError(f"the Authorization header uses {named}; octacloud takes 'Authorization: Bearer <key>'")


def _add_missing_columns(engine: Engine) -> None:
    """Bring a tenant table written by an older octacloud up to date: quota columns added since are created,
    empty (no limit)."""
    for column in ("tokens_per_minute", "max_streams"):
        if column in {c["name"] for c in inspect(engine).get_columns("tenants")}:
            continue
        try:
            with engine.begin() as connection:
                connection.execute(text(f"ALTER TABLE tenants ADD COLUMN {column} INTEGER"))
        except SQLAlchemyError:  # another process sharing the database added it first
            if column not in {c["name"] for c in inspect(engine).get_columns("tenants")}:
                raise


def check_quota_fields(q: Quota) -> None:
    """Raise :class:`InvalidSpecError` unless every limit of ``q`` is a number of its type within range."""
    if q.octants is not None:
        fields.whole(q.octants, "quota octants", 0, MAX_QUOTA_OCTANTS)
    if q.deployments is not None:
        fields.whole(q.deployments, "quota deployments", 0, MAX_QUOTA_DEPLOYMENTS)
    if q.requests_per_s is not None:
        fields.number(q.requests_per_s, "quota requests_per_s", MAX_RATE)
    fields.whole(q.burst, "quota burst", 1, MAX_BURST)
    if q.tokens_per_minute is not None:
        fields.whole(q.tokens_per_minute, "quota tokens_per_minute", 1, MAX_TOKENS_PER_MINUTE)
    if q.max_streams is not None:
        fields.whole(q.max_streams, "quota max_streams", 0, MAX_STREAMS)


def _tenant(row: _TenantRow) -> Tenant:
    quota = Quota(
        row.quota_octants, row.quota_deployments, row.requests_per_s, row.burst, row.tokens_per_minute, row.max_streams
    )
    return Tenant(row.name, quota, row.disabled, row.created_at)


def _key(row: _KeyRow) -> KeyInfo:
    return KeyInfo(row.id, row.tenant, Role(row.role), row.created_at, row.revoked, row.note)
