"""The published evaluation protocol of the FGD paper, as the authors' simulator runs it.

1. Shuffle the trace's pods with the seed.
2. Inflate: append pods drawn uniformly with replacement from the trace until the next draw would take the total
   requested GPU above ``tune`` × capacity; if the trace alone is above, drop random pods until it is not.
3. Replay: place pods one by one on an initially empty cluster, no departures; a pod that fits nowhere fails and
   stays failed (it still counts as arrived).

Two details follow the authors' code (``TunePodsByNodeTotalResource``): the stop test of inflation compares the
total plus the drawn pod's *per-card* milli-GPU with the target (so a drawn multi-card pod may overshoot it), and
draws come from the trace in name order, not from the shuffled list. Inflated copies are named
``<name>-tuned-<i>``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request
from octacloud.scheduler.framework import Decision, Scheduler

OnPod = Callable[[int, Request, Decision, float], None]
"""Called after each pod: ``(index, request, decision, seconds the decision took)``."""


def inflate(pods: Sequence[Request], *, seed: int, tune: float, capacity_milli: int) -> list[Request]:
    """The workload of one published run: ``pods`` shuffled with ``seed`` and tuned to ``tune`` × capacity.

    ``tune <= 0`` only shuffles. Deterministic for a given ``(pods, seed, tune, capacity_milli)``.
    """
    if not pods:
        raise InvalidSpecError("inflate: the trace has no pods")
    if capacity_milli <= 0:
        raise InvalidSpecError(f"inflate: capacity_milli must be > 0, got {capacity_milli}")
    if tune != tune:  # NaN
        raise InvalidSpecError("inflate: tune must be a number, got NaN")
    rng = random.Random(seed)
    out = list(pods)
    rng.shuffle(out)
    if tune <= 0:
        return out
    target = tune * capacity_milli
    total = sum(p.total_gpu_milli for p in out)
    if total > target:
        while total > target:
            total -= out.pop(rng.randrange(len(out))).total_gpu_milli
        return out
    source = sorted(pods, key=lambda p: p.name)
    names = {p.name for p in pods}
    i = 0
    while True:
        drawn = source[rng.randrange(len(source))]
        if total + drawn.gpu_milli > target:
            return out
        name = f"{drawn.name}-tuned-{i}"
        while name in names:
            name += "'"
        names.add(name)
        out.append(replace(drawn, name=name))
        total += drawn.total_gpu_milli
        i += 1


def replay(scheduler: Scheduler, requests: Sequence[Request], on_pod: OnPod) -> None:
    """Place ``requests`` in order with ``scheduler`` (no departures), reporting each decision to ``on_pod``."""
    clock = time.perf_counter
    schedule = scheduler.schedule
    for index, request in enumerate(requests):
        start = clock()
        decision = schedule(request)
        elapsed = clock() - start
        on_pod(index, request, decision, elapsed)
