"""The batching policy alone: pure decisions over a queue and a ManualClock."""

from __future__ import annotations

import pytest

from octacloud.core.clock import ManualClock
from octacloud.serving.batching.policy import BatchingSettings, BatchPolicy, Pending, QueuePolicy
from octacloud.serving.repository.config import parse_config

MS = 1e-3


def queue(clock: ManualClock, *arrivals_ms: float, rows: int = 1) -> list[Pending]:
    return [Pending(arrival=clock.monotonic() + a * MS, rows=rows) for a in arrivals_ms]


def test_nothing_waits_nothing_to_do() -> None:
    assert BatchPolicy(BatchingSettings(max_batch_size=8)).decide([], 0.0, 8).batch == ()


@pytest.mark.parametrize(
    ("waiting", "waited_ms", "expect_batch"),
    [
        (1, 0.0, False),  # one request, fresh: wait for company
        (3, 0.5, False),  # three wait: not yet ("more than 3")
        (4, 0.0, True),  # four wait: merge now
        (1, 2.0, True),  # the oldest waited the delay (2 ms)
        (2, 1.99, False),
    ],
)
def test_design_defaults_merge_after_more_than_three_or_the_delay(
    waiting: int, waited_ms: float, expect_batch: bool
) -> None:
    clock = ManualClock()
    policy = BatchPolicy(BatchingSettings(max_batch_size=32, max_queue_delay_us=2000))
    q = queue(clock, *([0.0] * waiting))
    clock.advance(waited_ms * MS)
    d = policy.decide(q, clock.monotonic(), cap=32)
    assert bool(d.batch) is expect_batch
    if expect_batch:
        assert d.batch == tuple(range(waiting))
    else:
        assert d.wake_at == pytest.approx(2 * MS)


def test_wake_up_time_is_when_the_oldest_reaches_the_delay() -> None:
    clock = ManualClock()
    policy = BatchPolicy(BatchingSettings(max_batch_size=8, max_queue_delay_us=2000))
    q = queue(clock, 0.0, 0.7)
    clock.advance(1 * MS)
    d = policy.decide(q, clock.monotonic(), 8)
    assert d.batch == ()
    assert d.wake_at == pytest.approx(2 * MS)
    clock.advance(1 * MS)
    assert policy.decide(q, clock.monotonic(), 8).batch == (0, 1)


def test_batch_respects_the_cap_and_the_max_batch_size() -> None:
    clock = ManualClock()
    policy = BatchPolicy(BatchingSettings(max_batch_size=4, max_queue_delay_us=2000))
    q = queue(clock, *([0.0] * 10))
    assert policy.decide(q, 0.0, cap=100).batch == (0, 1, 2, 3)  # max_batch_size wins
    assert policy.decide(q, 0.0, cap=3).batch == (0, 1, 2)  # the memory cap wins


def test_a_full_batch_goes_at_once_even_before_the_delay() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=4, max_queue_delay_us=100_000, merge_after=99))
    q = [Pending(0.0, rows=2), Pending(0.0, rows=2)]
    assert policy.decide(q, 0.0, 4).batch == (0, 1)


def test_rows_count_not_requests() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=8, max_queue_delay_us=0))
    q = [Pending(0.0, rows=3), Pending(0.0, rows=4), Pending(0.0, rows=2)]
    assert policy.decide(q, 0.0, 8).batch == (0, 1)  # 3 + 4 = 7; adding 2 would exceed 8


def test_zero_delay_dispatches_whatever_waits() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=8, max_queue_delay_us=0))
    assert policy.decide([Pending(0.0)], 0.0, 8).batch == (0,)


def test_no_batching_runs_one_request_at_a_time() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=0))
    assert policy.decide([Pending(0.0), Pending(0.0)], 0.0, 1).batch == (0,)


def test_preferred_batch_size_waits_for_it_then_takes_exactly_it() -> None:
    s = BatchingSettings(max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_us=5000)
    policy = BatchPolicy(s)
    assert policy.decide([Pending(0.0)] * 6, 0.0, 16).batch == ()  # 6 < 8: wait (no "more than 3" rule)
    assert policy.decide([Pending(0.0)] * 9, 0.0, 16).batch == tuple(range(8))
    # after the delay, whatever waits goes
    assert policy.decide([Pending(0.0)] * 6, 0.006, 16).batch == tuple(range(6))


def test_priority_levels_take_the_higher_priority_first() -> None:
    s = BatchingSettings(max_batch_size=2, priority_levels=2, default_priority=2, max_queue_delay_us=0)
    q = [Pending(0.0, priority=2), Pending(0.1, priority=1), Pending(0.2, priority=2), Pending(0.3, priority=1)]
    assert BatchPolicy(s).decide(q, 1.0, 2).batch == (1, 3)


def test_timeout_reject_expires_and_delay_moves_to_the_back() -> None:
    clock = ManualClock()
    s = BatchingSettings(max_batch_size=2, max_queue_delay_us=0)
    q = [
        Pending(0.0, deadline=1 * MS, reject_on_timeout=True),
        Pending(0.0, deadline=1 * MS, reject_on_timeout=False),
        Pending(0.0),
        Pending(0.0),
    ]
    clock.advance(2 * MS)
    d = BatchPolicy(s).decide(q, clock.monotonic(), 2)
    assert d.expired == (0,)
    assert d.batch == (2, 3)  # the delayed one (1) comes after the others


def test_waiting_wakes_up_for_the_earliest_deadline() -> None:
    s = BatchingSettings(max_batch_size=8, max_queue_delay_us=10_000)
    d = BatchPolicy(s).decide([Pending(0.0, deadline=3 * MS)], 0.0, 8)
    assert d.batch == ()
    assert d.wake_at == pytest.approx(3 * MS)


def test_settings_from_a_triton_config() -> None:
    config = parse_config(
        """
        max_batch_size: 16
        dynamic_batching {
          preferred_batch_size: [8, 4]
          max_queue_delay_microseconds: 500
          priority_levels: 2
          default_priority_level: 2
          default_queue_policy { max_queue_size: 10 timeout_action: DELAY default_timeout_microseconds: 7 }
          priority_queue_policy { key: 1 value: { max_queue_size: 3 allow_timeout_override: true } }
        }
        """
    )
    s = BatchingSettings.from_config(config)
    assert s.max_batch_size == 16
    assert s.preferred_batch_sizes == (4, 8)
    assert s.max_queue_delay_us == 500
    assert s.queue_policy(2) == QueuePolicy(timeout_us=7, reject_on_timeout=False, max_queue_size=10)
    assert s.queue_policy(1).max_queue_size == 3
    assert s.level_of(0) == 2
    assert s.level_of(1) == 1
    assert s.deadline_of(1.0, 1, requested_timeout_us=1000) == (pytest.approx(1.001), True)
    assert s.deadline_of(1.0, 2, requested_timeout_us=1000)[0] == pytest.approx(1.0 + 7e-6)  # no override


def test_a_model_without_dynamic_batching_runs_requests_alone() -> None:
    s = BatchingSettings.from_config(parse_config("max_batch_size: 8"))
    assert s.max_queue_delay_us == 0
    assert BatchPolicy(s).decide([Pending(0.0)] * 3, 0.0, 8).batch == (0, 1, 2)


def test_expire_while_busy_rejects_only_timed_out_reject_requests() -> None:
    q = [
        Pending(0.0, deadline=1.0),
        Pending(0.0, deadline=1.0, reject_on_timeout=False),
        Pending(0.0, deadline=3.0),
        Pending(0.0),
    ]
    assert BatchPolicy.expire(q, 2.0) == ((0,), 3.0)
    assert BatchPolicy.expire(q, 0.5) == ((), 1.0)


def test_requests_of_different_groups_never_share_a_batch() -> None:
    # groups: the shapes after the batch axis (batcher.batch_group); the oldest request's group goes first
    policy = BatchPolicy(BatchingSettings(max_batch_size=8, max_queue_delay_us=2000))
    q = [Pending(0.0, group="a"), Pending(0.0, group="b"), Pending(0.0, group="a"), Pending(0.0, group="b")]
    assert policy.decide(q, 0.0, 8).batch == ()  # two of each group: each waits for company or the delay
    assert policy.decide(q, 2 * MS, 8).batch == (0, 2)
    assert policy.decide(q[1:2] + q[3:], 2 * MS, 8).batch == (0, 1)
    q += [Pending(0.0, group="a"), Pending(0.0, group="a")]
    assert policy.decide(q, 0.0, 8).batch == (0, 2, 4, 5)  # four of group a: merge now
    assert policy.decide(q, 0.0, 3).batch == (0, 2, 4)  # a full batch of group a goes at once


def test_a_request_that_shares_with_no_one_goes_at_once_even_behind_a_waiting_group() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=8, max_queue_delay_us=2000))
    assert policy.decide([Pending(0.0, group=object(), alone=True)], 0.0, 8).batch == (0,)
    q = [Pending(0.0, group="alice"), Pending(0.0, group=object(), alone=True), Pending(0.0, group="alice")]
    assert policy.decide(q, 0.0, 8).batch == (1,)  # alice's two wait for company or the delay; it does not
    assert policy.decide([q[0], q[2]], 2 * MS, 8).batch == (0, 1)
