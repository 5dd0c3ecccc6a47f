"""Where batches run: inline on the loop when they are short, on the model thread otherwise."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from octacloud.serving.batching.handoff import BatchHandoff, InlinePolicy, threshold_us


@pytest.mark.parametrize(
    ("times_us", "inline"),
    [
        ([100] * 7, False),  # too few samples yet
        ([100] * 8, True),
        ([5000] * 20, False),
        ([100] * 10 + [1500] * 3, True),  # hysteresis: under twice the threshold it stays inline
        ([100] * 10 + [50_000] * 3, False),  # batches grew long: back to the thread
    ],
)
def test_policy(times_us: list[int], inline: bool) -> None:
    p = InlinePolicy(inline_below_ns=1_000_000)
    for t in times_us:
        p.observe(t * 1000)
    assert p.inline is inline


def test_a_zero_threshold_never_runs_inline() -> None:
    p = InlinePolicy(inline_below_ns=0)
    for _ in range(50):
        p.observe(1)
    assert not p.inline


def test_short_batches_move_onto_the_loop_and_long_ones_back() -> None:
    async def go() -> None:
        loop_thread = threading.get_ident()
        with ThreadPoolExecutor(1) as pool:
            h = BatchHandoff(pool, instances=1, inline_below_us=1000)
            where = [await h.run(threading.get_ident) for _ in range(12)]
            assert where[0] != loop_thread and where[-1] == loop_thread

            def slow() -> int:
                threading.Event().wait(0.01)
                return threading.get_ident()

            where = [await h.run(slow) for _ in range(40)]
            assert where[-1] != loop_thread
            many = BatchHandoff(pool, instances=2, inline_below_us=1000)
            assert all([await many.run(threading.get_ident) != loop_thread for _ in range(12)])

    asyncio.run(go())


def test_errors_propagate_from_both_places() -> None:
    async def go() -> None:
        with ThreadPoolExecutor(1) as pool:
            h = BatchHandoff(pool, instances=1, inline_below_us=1000)

            def boom() -> None:
                raise RuntimeError("model failed")

            for _ in range(12):
                with pytest.raises(RuntimeError, match="model failed"):
                    await h.run(boom)
            assert h.policy.inline

    asyncio.run(go())


def test_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCTACLOUD_INLINE_BATCH_US", "0")
    assert threshold_us() == 0
    monkeypatch.setenv("OCTACLOUD_INLINE_BATCH_US", "fast")
    with pytest.raises(ValueError, match="OCTACLOUD_INLINE_BATCH_US"):
        threshold_us()
    monkeypatch.delenv("OCTACLOUD_INLINE_BATCH_US")
    assert threshold_us() == 1000
