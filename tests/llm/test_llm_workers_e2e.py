"""End to end: a tenant's generation limits hold across two gateway workers (the main process holds them).

A cloud with two gateway workers serves the real SmolLM2 to tenant ``alice``. With ``max_streams`` 2, two streams
held at a stopped replica fill it: a third, on fresh connections that the kernel spreads over both workers, is
OpenAI's 429 whichever worker it lands on; ``kill -9`` of a worker that holds one gives its slot back, and once
the replica resumes the survivor ends and new streams are admitted. With ``tokens_per_minute`` spent through one
worker, the other refuses as well.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from octacloud.app import CloudConfig
from octacloud.control.controller import ControllerSettings

from ..cluster.test_cloud_e2e import CloudThread, wait_until
from .test_llm_e2e import MODELS, _needs

pytestmark = [pytest.mark.slow, pytest.mark.models]

STORY = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 40}
TRIES = 8
"""Fresh connections for a request that must be refused: all on one of two workers in 1 run of 128."""


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    _needs()
    root = tmp_path_factory.mktemp("llm-workers")
    repo = root / "models"
    repo.mkdir()
    (repo / "smollm2").symlink_to((MODELS / "smollm2").resolve(), target_is_directory=True)
    config = CloudConfig(
        repository=repo,
        state_dir=root / "var",
        http_port=0,
        grpc_port=0,
        gateway_workers=2,
        # a stopped replica is not replaced during the test
        controller=ControllerSettings(
            interval_s=0.5,
            health_interval_s=0.2,
            backoff_base_s=0.2,
            stop_grace_s=5,
            probe_failures_to_fail=1000,
            probe_timeout_s=0.2,
        ),
    )
    c = CloudThread(config)
    try:
        assert c.admin("POST", "/tenants", {"name": "alice"}).status_code == 201
        c.alice = c.admin("POST", "/keys", {"tenant": "alice"}).json()["key"]  # type: ignore[attr-defined]
        body = {"name": "smollm2", "model": "smollm2", "octants": 4, "tenant": "alice"}
        assert c.admin("POST", "/deployments", body).status_code == 201
        wait_until("smollm2 ready at both workers", lambda: all(_story(c) == 200 for _ in range(TRIES)), 240, 1.0)
        yield c
    finally:
        c.stop(stop_replicas=True)


def _story(c: CloudThread, stream: bool = False) -> int:
    """A chat completion on a fresh connection: its status once it ended."""
    headers = {"Authorization": f"Bearer {c.alice}", "Content-Type": "application/json"}  # type: ignore[attr-defined]
    with (
        httpx.Client(timeout=120) as http,
        http.stream(
            "POST", f"{c.url}/v1/chat/completions", content=json.dumps({**STORY, "stream": stream}), headers=headers
        ) as answer,
    ):
        body = answer.read()
        if answer.status_code == 429:
            error = json.loads(body)["error"]
            assert error["type"] == "rate_limit_error" and int(answer.headers["retry-after"]) >= 1, error
        return answer.status_code


def _quota(c: CloudThread, **quota: int | None) -> None:
    assert c.admin("POST", "/tenants/alice/quota", quota).status_code == 200


def test_a_tenants_streams_are_bounded_over_both_workers_and_a_killed_worker_gives_its_back(cloud: CloudThread) -> None:
    c = cloud
    hub = c.cloud.gateway_workers.hub  # type: ignore[union-attr]
    _quota(c, max_streams=2)
    [instance] = c.deployment("smollm2")["instances"]
    os.kill(instance["pid"], signal.SIGSTOP)  # streams admitted now wait at the replica until it resumes
    pool = ThreadPoolExecutor(2 + TRIES)
    try:
        held: list[Future[int]] = []
        for n in (1, 2):
            held.append(pool.submit(_story, c, True))
            wait_until(f"{n} stream(s) admitted", lambda n=n: hub.generations.in_flight("alice") == n, 30)
        assert [_story(c, True) for _ in range(TRIES)] == [429] * TRIES  # whichever worker each lands on
        holders = {key for key, holds in hub.generations._held.items() if holds}
        victim = next(iter(holders))
        kept = 2 - len(hub.generations._held[victim])
        os.kill(victim % 2**32, signal.SIGKILL)  # a worker's key is its index × 2³² + its pid
        wait_until("the killed worker's streams back", lambda: hub.generations.in_flight("alice") == kept, 30)
    finally:
        os.kill(instance["pid"], signal.SIGCONT)
    outcomes = [f.exception(timeout=120) or f.result() for f in held]
    assert outcomes.count(200) == kept, outcomes  # the survivor's stream ended whole; the killed one's broke off
    wait_until("the worker restarted", lambda: len(hub.serving()) == 2, 30)
    wait_until("no stream in flight", lambda: hub.generations.in_flight("alice") == 0, 30)
    finished = [pool.submit(_story, c, True) for _ in range(2)]
    assert [f.result(timeout=120) for f in finished] == [200, 200]
    pool.shutdown()
    _quota(c, max_streams=None)


def test_a_tenants_tokens_per_minute_are_spent_once_over_both_workers(cloud: CloudThread) -> None:
    c = cloud
    _quota(c, tokens_per_minute=1)
    try:
        # one completion, through either worker, leaves the budget of 1 token a minute in debt for minutes
        wait_until("the budget spent", lambda: _story(c) == 429, 60, 0.5)
        assert [_story(c) for _ in range(TRIES)] == [429] * TRIES
    finally:
        _quota(c, tokens_per_minute=None)
    assert _story(c) == 200
