"""A tenant's generation limits held by the main process for every gateway worker (``gateway/generations.py``):
two workers' :class:`RemoteGenerationLimits` wired to one :class:`GenerationOwner` as the feed wires them (each
message through JSON), on a manual clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from octacloud.core.clock import ManualClock
from octacloud.gateway.generations import GenerationOwner, RemoteGenerationLimits
from octacloud.gateway.sharing import ShareError
from octacloud.protocols.asgi import HttpError
from octacloud.tenancy.keys import Quota
from octacloud.tenancy.tokens import GenerationLimits, OverLimitError


class Wire:
    """Worker ``index``'s feed: its messages reach the owner, and the owner's answers come back, in order, when
    :meth:`deliver` is called (or at once with ``auto``)."""

    def __init__(self, owner: GenerationOwner, index: int, auto: bool = True) -> None:
        self.owner = owner
        self.index = index
        self.auto = auto
        self.replies: list[dict[str, Any]] = []
        self.remote = RemoteGenerationLimits(self.send)

    def send(self, message: dict[str, Any]) -> None:
        message = json.loads(json.dumps(message))
        if message["t"] == "admit":
            self.replies.append(json.loads(json.dumps(self.owner.admit(self.index, message))))
            if self.auto:
                asyncio.get_running_loop().call_soon(self.deliver)
        else:
            self.owner.settle(self.index, message)

    def deliver(self) -> None:
        while self.replies:
            self.remote.answer(self.replies.pop(0))


def owner() -> GenerationOwner:
    return GenerationOwner(GenerationLimits(ManualClock()))


def test_two_workers_hold_a_tenant_to_its_streams_together_and_a_killed_one_gives_its_back() -> None:
    async def run() -> None:
        o = owner()
        one, two = Wire(o, 1), Wire(o, 2)
        quota = Quota(max_streams=2)
        first = await one.remote.ask("t", quota, 10)
        await two.remote.ask("t", quota, 10)
        for wire in (one, two):  # the third, whichever worker it lands on
            with pytest.raises(OverLimitError, match="2 generation"):
                await wire.remote.ask("t", quota, 10)
        assert await two.remote.ask("other", quota, 10)  # another tenant has its own count
        one.remote.settle(first, 3)
        third = await two.remote.ask("t", quota, 10)
        o.gone(2)  # worker 2 killed with -9: the streams it held come back
        assert o.in_flight("t") == 0 and o.in_flight("other") == 0
        two.remote.settle(third, 5)  # a settle after its worker was found gone changes nothing
        assert o.in_flight("t") == 0
        await one.remote.ask("t", quota, 10)
        await one.remote.ask("t", quota, 10)

    asyncio.run(run())


def test_two_workers_share_one_token_budget() -> None:
    async def run() -> None:
        o = owner()
        one, two = Wire(o, 1), Wire(o, 2)
        quota = Quota(tokens_per_minute=100)
        hold = await one.remote.ask("t", quota, 150)  # admitted while not in debt, now 50 in debt
        with pytest.raises(OverLimitError) as caught:
            await two.remote.ask("t", quota, 1)
        assert caught.value.retry_after == 31  # 51 tokens at 100 a minute
        one.remote.settle(hold, 20)  # replaced by what was used: 80 left
        assert o.limits.level("t") == pytest.approx(80)
        o.gone(1)
        unlimited = await two.remote.ask("t", Quota(), 10**6)  # no limit: the owner is not asked
        assert unlimited.ticket == 0 and o.in_flight("t") == 0

    asyncio.run(run())


def test_an_admission_its_request_gave_up_on_is_settled_when_it_arrives() -> None:
    async def run() -> None:
        o = owner()
        wire = Wire(o, 1, auto=False)
        quota = Quota(max_streams=1)
        waiting = asyncio.create_task(wire.remote.ask("t", quota, 0))
        await asyncio.sleep(0)
        waiting.cancel()  # the client went away while the owner's answer was on its way
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert o.in_flight("t") == 1
        wire.deliver()
        assert o.in_flight("t") == 0
        wire.remote.timeout_s = 0.01  # an owner that never answers: 503, and its late admission is settled
        with pytest.raises(HttpError) as caught:
            await wire.remote.ask("t", quota, 0)
        assert caught.value.status == 503
        wire.deliver()
        assert o.in_flight("t") == 0
        closed = asyncio.create_task(wire.remote.ask("t", quota, 0))
        await asyncio.sleep(0)
        wire.remote.close()  # the feed ended
        with pytest.raises(HttpError, match="not reachable"):
            await closed

    asyncio.run(run())


@pytest.mark.parametrize(
    "message",
    [
        {"t": "admit", "id": 0, "tenant": "t", "estimate": 1},
        {"t": "admit", "id": 1, "tenant": 3, "estimate": 1},
        {"t": "admit", "id": 1, "tenant": "t", "estimate": -1},
        {"t": "admit", "id": 1, "tenant": "t", "estimate": 1, "streams": "2"},
        {"t": "admit", "id": True, "tenant": "t", "estimate": 1},
    ],
)
def test_a_malformed_admit_is_refused_holding_nothing(message: dict[str, Any]) -> None:
    o = owner()
    with pytest.raises(ShareError):
        o.admit(1, message)
    assert o.limits.streams == {}


def test_an_admit_id_held_twice_or_a_malformed_settle_is_refused() -> None:
    o = owner()
    assert o.admit(1, {"id": 1, "tenant": "t", "estimate": 0, "streams": 5})["t"] == "admitted"
    with pytest.raises(ShareError, match="already held"):
        o.admit(1, {"id": 1, "tenant": "t", "estimate": 0, "streams": 5})
    with pytest.raises(ShareError):
        o.settle(1, {"id": 1, "used": "all"})
    assert o.in_flight("t") == 1
    o.settle(1, {"id": 1, "used": 0})
    assert o.in_flight("t") == 0
