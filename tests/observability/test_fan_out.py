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
