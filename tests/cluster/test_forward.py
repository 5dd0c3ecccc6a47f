"""The gateway's forwarding core (gateway/forward.py), with fake asks in place of a protocol: the same mechanism
every front (REST, gRPC, OpenAI's API) runs."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from octacloud.gateway.forward import MAX_ATTEMPTS, Exhausted, Forwarding, TimedOut, Unanswered
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.routing import DeploymentCounters, Endpoint, NotAdmitted, Owner, RouteTable
from octacloud.metering import Traffic
from octacloud.tenancy import ANONYMOUS_ADMIN, AuthError

T = TypeVar("T")


def core(replicas: int = 2, ready: bool = True) -> Forwarding:
    now = [0.0]
    table = RouteTable(now=lambda: now[0])
    table.update("m", [Endpoint(f"r{i}", "127.0.0.1", 1000 + i, 2000 + i) for i in range(replicas)])
    table.owners["m"] = Owner("acme")
    return Forwarding(table, None, GatewayLimits(max_inflight_per_replica=2), lambda: ready)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_replica_that_gives_no_answer_is_failed_and_the_next_one_answers() -> None:
    fwd = core()
    counters = fwd.routes.counter("m")
    asked: list[str] = []

    async def ask(e: Endpoint) -> str:
        asked.append(e.replica_id)
        assert e.outstanding == 1  # counted while it is asked
        if len(asked) == 1:
            raise Unanswered("connection refused")
        return f"answer of {e.replica_id}"

    answer, endpoint = run(fwd.forward("m", counters, 10, ask, 1.0))
    assert answer == f"answer of {asked[1]}" and endpoint.replica_id == asked[1] and asked[0] != asked[1]
    failed = next(e for e in fwd.routes.routes["m"] if e.replica_id == asked[0])
    assert (failed.failures, endpoint.failures) == (1, 0)
    assert all(e.outstanding == 0 for e in fwd.routes.routes["m"])
    assert (counters.requests, counters.bytes_in, counters.failures) == (1, 10, 0)


def test_no_replica_answering_is_exhausted_after_each_was_tried_once_and_counted_a_failure() -> None:
    fwd = core(replicas=MAX_ATTEMPTS + 1)
    counters = fwd.routes.counter("m")
    asked: list[str] = []

    async def ask(e: Endpoint) -> str:
        asked.append(e.replica_id)
        raise Unanswered("reset")

    with pytest.raises(Exhausted, match=f"{MAX_ATTEMPTS} replica\\(s\\) tried, none answered") as refused:
        run(fwd.forward("m", counters, 0, ask, 1.0))
    assert len(asked) == len(set(asked)) == MAX_ATTEMPTS and refused.value.retry_after >= 1
    assert counters.failures == 1


def test_a_timeout_is_not_retried_and_counts_against_the_replica() -> None:
    fwd = core()
    counters = fwd.routes.counter("m")
    asked: list[Endpoint] = []

    async def ask(e: Endpoint) -> str:
        asked.append(e)
        raise TimeoutError

    with pytest.raises(TimedOut, match="no answer within 0.5 s"):
        run(fwd.forward("m", counters, 0, ask, 0.5))
    assert len(asked) == 1 and asked[0].failures == 1 and asked[0].outstanding == 0 and counters.failures == 1


def test_an_ejected_replica_is_not_asked_and_the_refusal_says_when_to_retry() -> None:
    fwd = core(replicas=1)
    counters = fwd.routes.counter("m")
    [endpoint] = fwd.routes.routes["m"]
    for _ in range(3):
        fwd.routes.failed(endpoint)

    async def ask(e: Endpoint) -> str:
        raise AssertionError("an ejected replica was asked")

    with pytest.raises(Exhausted, match="has no ready replica") as refused:
        run(fwd.forward("m", counters, 0, ask, 1.0))
    assert refused.value.retry_after >= 1


def test_hold_keeps_the_replica_counted_until_the_caller_gives_it_back() -> None:
    fwd = core(replicas=1)

    async def ask(e: Endpoint) -> str:
        return "head"

    _, endpoint = run(fwd.forward("m", fwd.routes.counter("m"), 0, ask, 1.0, hold=True))
    assert endpoint.outstanding == 1


def test_admission_and_the_in_flight_slot() -> None:
    fwd = core(replicas=1)
    assert isinstance(fwd.admit("nothing", ANONYMOUS_ADMIN), NotAdmitted)
    counters = fwd.admit("m", ANONYMOUS_ADMIN)
    assert isinstance(counters, DeploymentCounters)
    with fwd.flight(counters), fwd.flight(counters):
        assert counters.outstanding == 2
        full = fwd.admit("m", ANONYMOUS_ADMIN)  # the bound: 2 per replica
        assert isinstance(full, NotAdmitted) and full.why == "at capacity" and counters.shed == 1
    assert counters.outstanding == 0
    starting = core(ready=False).admit("m", ANONYMOUS_ADMIN)
    assert isinstance(starting, NotAdmitted) and starting.why == "starting"


def test_without_a_guard_every_caller_is_an_anonymous_admin() -> None:
    assert core().authorize([(b"authorization", b"Bearer nonsense")]) is ANONYMOUS_ADMIN


def test_with_a_guard_a_malformed_key_is_refused_and_a_second_tenant_sees_no_other_tenants_deployment(
    tmp_path: Path,
) -> None:
    from sqlalchemy import create_engine

    from octacloud.core.clock import ManualClock
    from octacloud.tenancy import Guard
    from octacloud.tenancy.keys import KeyStore, Role

    keys = KeyStore(create_engine(f"sqlite:///{tmp_path / 'keys.db'}"), b"k" * 32, ManualClock(), cache_s=0.0)
    secrets = {}
    for tenant in ("acme", "globex"):
        keys.create_tenant(tenant)
        _, secrets[tenant] = keys.create_key(tenant, Role.TENANT)
    fwd = core()
    fwd.guard = Guard(keys)
    for malformed in ([], [(b"authorization", b"Basic eA==")], [(b"authorization", b"Bearer \xff")]):
        with pytest.raises(AuthError):
            fwd.authorize(malformed)
    acme = fwd.authorize([(b"authorization", f"Bearer {secrets['acme']}".encode())])
    globex = fwd.authorize([(b"authorization", f"Bearer {secrets['globex']}".encode())])
    assert (acme.tenant, globex.tenant) == ("acme", "globex")
    assert isinstance(fwd.admit("m", acme), DeploymentCounters)
    hidden = fwd.admit("m", globex)  # acme's: to globex as unknown as a deployment that is not there
    assert isinstance(hidden, NotAdmitted) and hidden.why == "unknown"
    assert hidden.message == fwd.admit("nothing", globex).message.replace("nothing", "m")  # type: ignore[union-attr]


def test_settle_bills_an_answer_but_not_the_clouds_failure() -> None:
    counters, usage = DeploymentCounters(), Traffic()
    Forwarding.settle(counters, usage, 10, 20, failed=False, billed=True)
    Forwarding.settle(counters, usage, 10, 5, failed=True, billed=True)  # the request's error: billed
    Forwarding.settle(counters, usage, 10, 0, failed=True, billed=False)  # shed: not billed
    assert (counters.bytes_out, counters.failures) == (25, 2)
    assert (usage.requests, usage.bytes_in, usage.bytes_out) == (2, 20, 25)
