"""A running cloud with real replica processes, on its own event loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from octacloud.app import Cloud, CloudConfig
from octacloud.core import Node


class CloudThread:
    """A Cloud on its own loop, so tests can use blocking clients (httpx, tritonclient, a browser)."""

    def __init__(self, config: CloudConfig, nodes: list[Node]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cloud: Cloud = self._run(self._make(config, nodes))
        self._run(self.cloud.start())
        self.url = f"http://127.0.0.1:{self.cloud.http_port}"
        self.key = (config.state_dir / "admin.key").read_text().strip()  # as `octacloud up` users find it
        self.auth = {"Authorization": f"Bearer {self.key}"}

    @staticmethod
    async def _make(config: CloudConfig, nodes: list[Node]) -> Cloud:
        return Cloud(config, nodes=nodes)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        self._run(self.cloud.stop(stop_replicas=True))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=kwargs.pop("headers", self.auth), timeout=30, **kwargs)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.auth, timeout=30)


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def write_models(repo: Path) -> Path:
    from tests.cluster.conftest import write_linear_model

    write_linear_model(repo, "linear")
    write_linear_model(repo, "ranker")
    return repo
