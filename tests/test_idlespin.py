"""Idle spinning: a poke keeps the loop polling for the window after its last busy turn, then it sleeps;
off unless configured; a bad window is an error naming the variable."""

from __future__ import annotations

import asyncio

import pytest

from octacloud import idlespin
from octacloud.idlespin import GATEWAY_SPIN_ENV, REPLICA_SPIN_ENV, IdleSpin, window_us_from_env


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


class Loop:
    """A spinner on the running loop with a manual clock; ``idle`` advances it turn by turn."""

    def __init__(self, window_us: int) -> None:
        self.wall = Clock()
        self.spin = IdleSpin(asyncio.get_running_loop(), window_us, clock_ns=self.wall)

    async def idle(self, us: int, per_turn_us: int = 5) -> None:
        for _ in range(us // per_turn_us):
            self.wall.ns += per_turn_us * 1000
            await asyncio.sleep(0)


async def test_a_poke_spins_for_the_window_then_stops() -> None:
    t = Loop(100)
    t.spin.poke()
    assert t.spin.running
    await t.idle(95)
    assert t.spin.running and t.spin.ticks >= 10  # idle turns inside the window: polling
    await t.idle(15)
    assert not t.spin.running  # the window passed with nothing new
    ticks = t.spin.ticks
    for _ in range(5):
        await asyncio.sleep(0)
    assert t.spin.ticks == ticks  # stopped: nothing scheduled, the loop may sleep


async def test_the_window_counts_from_the_end_of_the_poked_turn_and_a_poke_restarts_it() -> None:
    t = Loop(100)
    t.spin.poke()
    await t.idle(60)
    t.spin.poke()  # data arrived, and its turn took 300 us of work
    t.wall.ns += 300_000
    await t.idle(90)
    assert t.spin.running  # 90 us after that turn ended
    await t.idle(20)
    assert not t.spin.running
    t.spin.poke()  # data arrived on a sleeping loop
    assert t.spin.running
    await t.idle(50)
    assert t.spin.running


async def test_spinning_keeps_the_loop_from_sleeping_but_not_from_running_other_work() -> None:
    loop = asyncio.get_running_loop()
    spin = IdleSpin(loop, 500_000)  # the real clocks: a 0.5 s window
    spin.poke()
    seen: list[tuple[bool, int]] = []
    loop.call_later(0.001, lambda: seen.append((spin.running, spin.ticks)))
    await asyncio.sleep(0.001)  # a timer still fires among the polls: inside the window, after some polls
    assert len(seen) == 1 and seen[0][0] and seen[0][1] >= 1
    assert spin.running and spin.ticks > 10
    await asyncio.sleep(0.8)
    assert not spin.running  # the window passed with no work: the loop sleeps


def test_the_window_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GATEWAY_SPIN_ENV, raising=False)
    assert window_us_from_env(GATEWAY_SPIN_ENV) == 0
    monkeypatch.setenv(GATEWAY_SPIN_ENV, "250")
    assert window_us_from_env(GATEWAY_SPIN_ENV) == 250
    for bad in ("fast", "-5", "1000000"):
        monkeypatch.setenv(GATEWAY_SPIN_ENV, bad)
        with pytest.raises(ValueError, match=GATEWAY_SPIN_ENV):
            window_us_from_env(GATEWAY_SPIN_ENV)


def test_poke_is_a_no_op_unless_installed_and_the_server_loop_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from octacloud.protocols.server import new_event_loop

    monkeypatch.delenv(REPLICA_SPIN_ENV, raising=False)
    monkeypatch.setenv(GATEWAY_SPIN_ENV, "300")
    loop = new_event_loop(REPLICA_SPIN_ENV)  # the gateway's window is not the replica's
    try:
        assert idlespin._current is None
        idlespin.poke()  # nothing to do, nothing raised
    finally:
        loop.close()
    loop = new_event_loop(GATEWAY_SPIN_ENV)
    try:
        spinner = idlespin._current
        assert spinner is not None and not spinner.running
        idlespin.poke()
        assert spinner.running
        loop.run_until_complete(asyncio.sleep(0.01))
        assert not spinner.running and spinner.ticks > 1
    finally:
        loop.close()
        idlespin.install(loop, 0)
    assert idlespin._current is None
    with pytest.raises(ValueError, match="positive"):
        IdleSpin(loop, 0)
