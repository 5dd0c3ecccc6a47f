"""bounded_gather: results in order, exceptions returned in place, never more than the limit in flight."""

from __future__ import annotations

import asyncio

import pytest

from octacloud.observability.replicas import bounded_gather


async def test_results_in_order_exceptions_in_place_and_at_most_limit_at_once() -> None:
    running, most = 0, 0

    async def job(k: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        running -= 1
        if k == 7:
            raise ValueError("seven")
        return k * k

    results = await bounded_gather((job(k) for k in range(100)), limit=5)
    assert most == 5
    assert results[:7] == [k * k for k in range(7)] and results[8:] == [k * k for k in range(8, 100)]
    assert isinstance(results[7], ValueError) and str(results[7]) == "seven"
    assert await bounded_gather([]) == []


async def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1, not 0"):
        await bounded_gather([], limit=0)


async def test_cancelled_while_waiting_leaves_no_coroutine_unawaited() -> None:
    gate = asyncio.Event()

    async def job() -> int:
        await gate.wait()
        return 1

    async def fail_soon() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("a sibling failed")

    async def both() -> None:
        async with asyncio.TaskGroup() as group:  # the group cancels the gather while most jobs wait their turn
            group.create_task(bounded_gather((job() for _ in range(10)), limit=2))
            group.create_task(fail_soon())

    with pytest.raises(ExceptionGroup):
        await both()
    # (pytest's filterwarnings=error fails the test on "coroutine 'job' was never awaited")
