"""A cloud that stops stores what it still had queued: events written in its last moments are not lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

from octacloud.control.store import StateStore
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config


def test_events_queued_while_stopping_are_stored(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_linear_model(repo)
    cfg = config(tmp_path, repo)
    c = CloudThread(cfg)
    store = c.cloud.controller.store

    close_monitoring = c.cloud.monitoring.close

    async def late_writer() -> None:  # after the controller's loop has ended and flushed: the last writers
        for i in range(200):
            store.add_event("node", "n1", f"last words {i}")
        await close_monitoring()

    c.cloud.monitoring.close = late_writer  # type: ignore[method-assign]
    c.stop(stop_replicas=True)
    reopened = StateStore.at(cfg.state_dir / "octacloud.db")
    try:
        messages = {str(e["message"]) for e in reopened.events(limit=1000)}
    finally:
        reopened.close()
    assert {f"last words {i}" for i in range(200)} <= messages


def test_a_task_that_will_not_end_is_cancelled_and_the_rest_of_the_stop_goes_on(tmp_path: Path) -> None:
    """The meter's last flush hangs (a scrape of a fleet that does not answer): after its 10 s the stop cancels it
    and carries on, so the store is still closed with everything queued stored."""
    repo = tmp_path / "models"
    write_linear_model(repo)
    cfg = config(tmp_path, repo)
    c = CloudThread(cfg)
    store = c.cloud.controller.store
    cancelled = []

    async def hangs() -> bool:
        store.add_event("node", "n1", "flushing")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return True

    c.cloud.meter.flush = hangs  # type: ignore[method-assign]
    c.stop(stop_replicas=True)
    assert cancelled == [True]
    reopened = StateStore.at(cfg.state_dir / "octacloud.db")
    try:
        assert "flushing" in {str(e["message"]) for e in reopened.events(limit=1000)}
    finally:
        reopened.close()
