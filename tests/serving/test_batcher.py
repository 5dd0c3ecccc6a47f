"""The batching mechanism around a model: asyncio, a fake runner, the real clock."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from octacloud.serving.batching import BatchingSettings, DynamicBatcher
from octacloud.serving.errors import ModelExecutionError, ModelNotReadyError, QueueFullError, QueueTimeoutError
from octacloud.serving.stats import ModelStats

Arrays = dict[str, npt.NDArray[Any]]


class Runner:
    """Doubles its input; records batch sizes; optionally slow or failing."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.delay = delay
        self.fail = fail

    async def __call__(self, inputs: Any) -> Arrays:
        x = inputs["x"]
        self.batches.append(int(x.shape[0]))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("boom")
        return {"y": x * 2}


def rows(start: int, n: int) -> Arrays:
    return {"x": np.arange(start, start + n, dtype=np.float32).reshape(n, 1)}


async def test_concurrent_requests_are_merged_and_each_gets_its_own_rows() -> None:
    runner = Runner(delay=0.02)
    stats = ModelStats()
    b = DynamicBatcher(BatchingSettings(max_batch_size=16, max_queue_delay_us=2000), runner, observer=stats)
    b.start()
    sizes = [1, 2, 3, 1, 4, 1]
    starts = np.cumsum([0, *sizes[:-1]])
    results = await asyncio.gather(*(b.submit(rows(int(s), n), n) for s, n in zip(starts, sizes, strict=True)))
    for s, n, r in zip(starts, sizes, results, strict=True):
        np.testing.assert_array_equal(r["y"], rows(int(s), n)["x"] * 2)
    assert sum(runner.batches) == sum(sizes)
    assert len(runner.batches) < len(sizes)  # some merging happened
    assert stats.inference_count == sum(sizes)
    assert stats.execution_count == len(runner.batches)
    assert stats.queue.count == len(sizes)
    await b.close()


async def test_a_request_larger_than_the_cap_is_split_and_rejoined_in_order() -> None:
    runner = Runner()
    b = DynamicBatcher(BatchingSettings(max_batch_size=8, max_queue_delay_us=0), runner, cap=lambda: 3)
    b.start()
    r = await b.submit(rows(0, 10), 10)
    np.testing.assert_array_equal(r["y"], rows(0, 10)["x"] * 2)
    assert max(runner.batches) <= 3
    assert sum(runner.batches) == 10
    await b.close()


async def test_a_failing_batch_fails_its_requests_only() -> None:
    runner = Runner(fail=True)
    b = DynamicBatcher(BatchingSettings(max_batch_size=4, max_queue_delay_us=0), runner, name="m")
    b.start()
    with pytest.raises(ModelExecutionError, match="boom"):
        await b.submit(rows(0, 1), 1)
    runner.fail = False
    assert (await b.submit(rows(0, 1), 1))["y"][0, 0] == 0
    await b.close()


async def test_queue_full_is_refused_with_a_clear_error() -> None:
    from octacloud.serving.batching.policy import QueuePolicy

    runner = Runner(delay=0.2)
    s = BatchingSettings(max_batch_size=1, max_queue_delay_us=0, default_queue=QueuePolicy(max_queue_size=1))
    b = DynamicBatcher(s, runner, name="m")
    b.start()
    first = asyncio.ensure_future(b.submit(rows(0, 1), 1))
    await asyncio.sleep(0.05)  # the first runs; the queue is empty again
    second = asyncio.ensure_future(b.submit(rows(1, 1), 1))
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError, match="max_queue_size 1"):
        await b.submit(rows(2, 1), 1)
    await asyncio.gather(first, second)
    await b.close()


async def test_queue_timeout_rejects() -> None:
    from octacloud.serving.batching.policy import QueuePolicy

    runner = Runner(delay=0.2)
    s = BatchingSettings(max_batch_size=1, max_queue_delay_us=0, default_queue=QueuePolicy(timeout_us=10_000))
    b = DynamicBatcher(s, runner, name="m")
    b.start()
    first = asyncio.ensure_future(b.submit(rows(0, 1), 1))
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(QueueTimeoutError, match="timed out"):
        await b.submit(rows(1, 1), 1)
    assert loop.time() - start < 0.15  # rejected at its deadline, not when the busy instance frees (0.2 s)
    assert not first.done()
    await first
    await b.close()


async def test_close_runs_what_is_queued_then_refuses() -> None:
    runner = Runner(delay=0.01)
    b = DynamicBatcher(BatchingSettings(max_batch_size=2, max_queue_delay_us=50_000), runner)
    b.start()
    pending = [asyncio.ensure_future(b.submit(rows(i, 1), 1)) for i in range(3)]
    await asyncio.sleep(0)
    await b.close()
    assert all(p.done() and not p.exception() for p in pending)
    with pytest.raises(ModelNotReadyError):
        await b.submit(rows(0, 1), 1)


async def test_a_cancelled_request_does_not_block_the_others() -> None:
    runner = Runner(delay=0.05)
    b = DynamicBatcher(BatchingSettings(max_batch_size=1, max_queue_delay_us=0), runner)
    b.start()
    first = asyncio.ensure_future(b.submit(rows(0, 1), 1))
    await asyncio.sleep(0.01)
    doomed = asyncio.ensure_future(b.submit(rows(1, 1), 1))
    await asyncio.sleep(0)
    doomed.cancel()
    last = await b.submit(rows(2, 1), 1)
    assert last["y"][0, 0] == 4
    await first
    assert runner.batches == [1, 1]
    await b.close()


async def test_beyond_max_pending_requests_are_refused_at_once_and_the_admitted_ones_stay_fast() -> None:
    runner = Runner(delay=0.01)
    b = DynamicBatcher(BatchingSettings(max_batch_size=4, max_queue_delay_us=0, max_pending=8), runner)
    b.start()
    outcomes = await asyncio.gather(*(b.submit(rows(i, 1)) for i in range(40)), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, QueueFullError)]
    served = [o for o in outcomes if isinstance(o, dict)]
    assert len(served) + len(refused) == 40
    assert 8 <= len(served) <= 12 and refused  # the queue held 8, plus what was already running
    assert "octacloud.max_pending" in str(refused[0]) and "retry later" in str(refused[0])
    assert len(runner.batches) <= 4  # the admitted requests waited a few batches, not ten
    await b.close()


def test_max_pending_default_and_parameter() -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    from octacloud.serving.errors import ModelConfigError

    config = mc.ModelConfig(max_batch_size=32)
    config.dynamic_batching.SetInParent()
    assert BatchingSettings.from_config(config).max_pending == 256
    assert BatchingSettings.from_config(mc.ModelConfig(max_batch_size=0)).max_pending == 64
    config.parameters["octacloud.max_pending"].string_value = "0"
    assert BatchingSettings.from_config(config).max_pending == 0  # unbounded
    config.parameters["octacloud.max_pending"].string_value = "many"
    with pytest.raises(ModelConfigError, match="octacloud.max_pending"):
        BatchingSettings.from_config(config)


async def test_while_the_oldest_request_waited_too_long_new_ones_are_refused() -> None:
    runner = Runner(delay=0.02)  # 50 batches/s at most; requests arrive at 200/s
    settings = BatchingSettings(max_batch_size=1, max_queue_delay_us=0, max_pending=0, max_queue_wait_us=60_000)
    b = DynamicBatcher(settings, runner)
    b.start()
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    refused: list[QueueFullError] = []

    async def one(i: int) -> None:
        t0 = loop.time()
        try:
            await b.submit(rows(i, 1))
        except QueueFullError as e:
            refused.append(e)
            return
        waits.append(loop.time() - t0)

    tasks = []
    for i in range(80):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    assert refused and waits
    assert "is overloaded" in str(refused[0]) and "octacloud.max_queue_wait_us" in str(refused[0])
    assert max(waits) < 0.5  # without the bound the last admitted would wait ~1.2 s
    await b.close()


def test_refusal_wait_default_and_overrides() -> None:
    auto = BatchingSettings(max_batch_size=8, max_queue_delay_us=2000)
    assert auto.refuse_after_s(0.001) == pytest.approx(0.05)  # the floor
    assert auto.refuse_after_s(0.1) == pytest.approx(0.4)  # four batches of a slow model
    assert BatchingSettings(max_batch_size=8, max_queue_delay_us=20_000).refuse_after_s(0) == pytest.approx(0.2)
    assert BatchingSettings(max_queue_wait_us=0).refuse_after_s(1.0) is None
    assert BatchingSettings(max_queue_wait_us=7000).refuse_after_s(1.0) == pytest.approx(0.007)
