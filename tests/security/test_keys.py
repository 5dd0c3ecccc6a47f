"""Keys, tenants, roles, quotas and rate limits, without servers (ManualClock)."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from octacloud.core.clock import ManualClock
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.database import open_engine
from octacloud.tenancy import (
    AuthError,
    Guard,
    Holding,
    KeyStore,
    Quota,
    QuotaExceededError,
    RateLimitedError,
    RateLimiter,
    Role,
    bearer,
    check_quota,
    server_secret,
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock, store_url: str) -> Iterator[KeyStore]:
    """A key store on each database (SQLite, then a real PostgreSQL server)."""
    engine = open_engine(store_url)
    yield KeyStore(engine, server_secret(tmp_path / "server.secret"), clock, cache_s=5.0)
    engine.dispose()


def test_a_key_authenticates_as_its_tenant_and_role(store: KeyStore) -> None:
    store.create_tenant("acme")
    info, key = store.create_key("acme")
    assert key.startswith(f"oc_{info.id}_") and len(key) > 40
    p = store.authenticate(key)
    assert (p.tenant, p.role, p.key_id) == ("acme", Role.TENANT, info.id)
    admin = store.ensure_admin()
    assert admin is not None and store.authenticate(admin).is_admin
    assert store.ensure_admin() is None  # one exists: no second bootstrap key


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("not-a-key", "malformed API key"),
        ("oc_0123456789ab_" + "x" * 43, "invalid API key"),
    ],
)
def test_bad_keys_are_refused(store: KeyStore, key: str | None, message: str) -> None:
    with pytest.raises(AuthError, match=message):
        store.authenticate(key)


def test_wrong_secret_revoked_and_disabled_are_refused_and_errors_hold_no_key_text(
    store: KeyStore, clock: ManualClock
) -> None:
    store.create_tenant("acme")
    info, key = store.create_key("acme")
    store.authenticate(key)  # now cached
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthError) as wrong:
        store.authenticate(forged)  # the cache compares digests too
    secret = key.split("_", 2)[2]
    assert secret not in str(wrong.value) and forged.split("_", 2)[2] not in str(wrong.value)
    store.revoke_key(info.id)
    with pytest.raises(AuthError, match="revoked") as revoked:
        store.authenticate(key)  # at once, not after the cache expires
    assert secret not in str(revoked.value)

    _, other = store.create_key("acme")
    store.authenticate(other)
    store.set_disabled("acme")
    with pytest.raises(AuthError, match="disabled"):
        store.authenticate(other)
    store.set_disabled("acme", False)
    assert store.authenticate(other).tenant == "acme"


def test_another_process_sees_a_revocation_within_the_cache_time(
    tmp_path: Path, store: KeyStore, clock: ManualClock
) -> None:
    store.create_tenant("acme")
    info, key = store.create_key("acme")
    other = KeyStore(store.engine, server_secret(tmp_path / "server.secret"), clock, cache_s=5.0)
    assert other.authenticate(key).tenant == "acme"
    store.revoke_key(info.id)
    assert other.authenticate(key).tenant == "acme"  # cached
    clock.advance(5.1)
    with pytest.raises(AuthError, match="revoked"):
        other.authenticate(key)


def test_only_a_keyed_digest_is_stored(store: KeyStore, tmp_path: Path) -> None:
    store.create_tenant("acme")
    _, key = store.create_key("acme")
    with store.engine.connect() as c:
        rows = c.execute(text("SELECT * FROM api_keys")).fetchall()
    dump = repr(rows)
    assert key not in dump and key.split("_", 2)[2] not in dump
    mode = stat.S_IMODE((tmp_path / "server.secret").stat().st_mode)
    assert mode == 0o600
    # another server secret cannot verify the key
    other = KeyStore(store.engine, b"s" * 32, store.clock)
    with pytest.raises(AuthError, match="invalid"):
        other.authenticate(key)


def test_tenant_and_key_errors_are_clear(store: KeyStore) -> None:
    with pytest.raises(InvalidSpecError, match="lowercase"):
        store.create_tenant("Bad Name")
    store.create_tenant("acme")
    with pytest.raises(InvalidSpecError, match="already exists"):
        store.create_tenant("acme")
    with pytest.raises(NotFoundError, match="create it first"):
        store.create_key("ghost")
    with pytest.raises(InvalidSpecError, match="admin keys belong"):
        store.create_key("acme", Role.ADMIN)
    with pytest.raises(InvalidSpecError, match="burst"):
        store.create_tenant("zed", Quota(burst=0))
    store.ensure_admin()
    with pytest.raises(InvalidSpecError, match="cannot be disabled"):
        store.set_disabled("admin")
    assert [t.name for t in store.tenants()] == ["acme", "admin"]


def test_bearer_and_guard_read_every_header_form(store: KeyStore) -> None:
    store.create_tenant("acme")
    _, key = store.create_key("acme")
    guard = Guard(store)
    for headers in (
        [(b"authorization", f"Bearer {key}".encode())],
        (("authorization", f"Bearer {key}"),),
        {"Authorization": f"bearer {key}"},
    ):
        assert guard.authorize(headers).tenant == "acme"  # type: ignore[arg-type]
    assert bearer("Basic abc") is None and bearer(None) is None and bearer("Bearer ") is None


def test_rate_limit_is_a_token_bucket_on_the_clock(clock: ManualClock) -> None:
    limiter = RateLimiter(clock)
    quota = Quota(requests_per_s=2.0, burst=3)
    assert [limiter.check("a", quota) for _ in range(3)] == [0, 0, 0]
    assert limiter.check("a", quota) == 1  # empty: one token comes in 0.5 s → Retry-After 1
    assert limiter.check("b", quota) == 0  # per tenant
    clock.advance(0.5)
    assert limiter.check("a", quota) == 0
    assert limiter.check("a", quota) == 1
    clock.advance(10)
    assert [limiter.check("a", quota) for _ in range(4)] == [0, 0, 0, 1]  # refilled to the burst, no more
    assert all(limiter.check("free", Quota()) == 0 for _ in range(1000))
    slow = Quota(requests_per_s=0.1, burst=1)
    assert limiter.check("s", slow) == 0 and limiter.check("s", slow) == 10


def test_guard_admit_raises_with_retry_after(store: KeyStore) -> None:
    store.create_tenant("acme", Quota(requests_per_s=1.0, burst=1))
    _, key = store.create_key("acme")
    guard = Guard(store)
    p = guard.authorize({"authorization": f"Bearer {key}"})
    guard.admit(p)
    with pytest.raises(RateLimitedError) as exc:
        guard.admit(p)
    assert exc.value.retry_after == 1 and key not in str(exc.value)


def test_quotas_count_deployments_at_their_maximum() -> None:
    quota = Quota(octants=8, deployments=2)
    held = [Holding("a", 2, 2)]
    check_quota("t", quota, held, Holding("b", 4, 1))  # 4 + 4 = 8 fits
    check_quota("t", quota, held, Holding("a", 4, 2))  # replacing a: 8 fits
    with pytest.raises(QuotaExceededError, match=r"may hold 8 octant\(s\).*= 6"):
        check_quota("t", quota, held, Holding("b", 3, 2))
    with pytest.raises(QuotaExceededError, match=r"may have 2 deployment\(s\) and has 2"):
        check_quota("t", quota, [*held, Holding("b", 1, 1)], Holding("c", 1, 1))
    check_quota("t", Quota(), [Holding(str(i), 8, 8) for i in range(50)], Holding("x", 8, 8))


def test_roles_see_and_manage() -> None:
    from octacloud.tenancy import Principal

    tenant = Principal("a", Role.TENANT, "k")
    admin = Principal("admin", Role.ADMIN, "k")
    assert tenant.may_see("a") and not tenant.may_see("b") and tenant.may_see("b", published=True)
    assert tenant.may_manage("a") and not tenant.may_manage("b")
    assert admin.may_see("b") and admin.may_manage("b")


def test_a_new_quota_reaches_cached_keys_at_once(store: KeyStore) -> None:
    store.create_tenant("acme", Quota(requests_per_s=1.0))
    _, key = store.create_key("acme")
    assert store.authenticate(key).quota.requests_per_s == 1.0
    store.set_quota("acme", Quota(octants=4, requests_per_s=None))
    assert store.authenticate(key).quota == Quota(octants=4)
    with pytest.raises(NotFoundError):
        store.set_quota("ghost", Quota())
    with pytest.raises(InvalidSpecError, match="octants"):
        store.set_quota("acme", Quota(octants=-1))


def test_a_tenant_table_from_before_token_quotas_gains_their_columns_and_keeps_its_tenants(
    clock: ManualClock, store_url: str
) -> None:
    engine = open_engine(store_url)
    with engine.begin() as c:  # the table as octacloud wrote it before tokens_per_minute and max_streams
        c.execute(text(
            "CREATE TABLE tenants (name VARCHAR(32) PRIMARY KEY, disabled BOOLEAN, quota_octants INTEGER, "
            "quota_deployments INTEGER, requests_per_s FLOAT, burst INTEGER, created_at FLOAT)"
        ))  # fmt: skip
        c.execute(text("INSERT INTO tenants VALUES ('acme', false, 8, NULL, 5.0, 10, 1.0)"))
    try:
        store = KeyStore(engine, b"s" * 32, clock)
        old = store.tenant("acme").quota
        assert (old.octants, old.requests_per_s, old.burst, old.tokens_per_minute, old.max_streams) == (
            8, 5.0, 10, None, None,
        )  # fmt: skip
        store.set_quota("acme", Quota(8, None, 5.0, 10, tokens_per_minute=6000, max_streams=2))
        again = KeyStore(engine, b"s" * 32, clock)  # another process on the database: nothing to add or lose
        assert (again.tenant("acme").quota.tokens_per_minute, again.tenant("acme").quota.max_streams) == (6000, 2)
    finally:
        engine.dispose()
