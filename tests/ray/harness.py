"""Driving a Cloud on the Ray backend from blocking test code (and from bench/ray.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from octacloud import app
from octacloud.app import Cloud, CloudConfig
from octacloud.control.controller import ControllerSettings


def ray_cloud(config: CloudConfig, cache_root: Path, storage: str | None = None) -> Cloud:
    """A Cloud on the connected Ray cluster, as ``octacloud up --backend ray`` builds it."""
    config.model_cache = cache_root
    config.model_storage = storage
    return app.ray_cloud(config)


def fast_config(state_dir: Path, repository: Path, policy: str = "octacloud") -> CloudConfig:
    return CloudConfig(
        repository=repository,
        state_dir=state_dir,
        http_port=0,
        grpc_port=0,
        policy=policy,
        controller=ControllerSettings(interval_s=0.5, health_interval_s=0.2, backoff_base_s=0.2, stop_grace_s=3),
    )


class CloudThread:
    """A Cloud on its own event loop in a background thread, so tests can use blocking clients."""

    def __init__(self, make: Callable[[], Cloud]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cloud: Cloud = self._run(self._make(make))
        self._run(self.cloud.start())
        self.url = f"http://127.0.0.1:{self.cloud.http_port}"
        key_file = self.cloud.config.state_dir / "admin.key"
        self.key = key_file.read_text().strip() if key_file.exists() else ""
        self.headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}

    @staticmethod
    async def _make(make: Callable[[], Cloud]) -> Cloud:
        return make()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the cloud's loop (the controller is not thread-safe)."""

        async def run() -> Any:
            return fn()

        return self._run(run())

    def stop(self, stop_replicas: bool = True) -> None:
        self._run(self.cloud.stop(stop_replicas=stop_replicas))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()  # else its self-pipe leaks (pytest reports the unclosed loop)

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin{path}", json=body, headers=self.headers, timeout=30)

    def deployment(self, name: str) -> dict[str, Any]:
        response = self.admin("GET", f"/deployments/{name}")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    def ready(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.deployment(name)["instances"] if r["state"] == "ready"]

    def infer(self, model: str, x: np.ndarray) -> np.ndarray:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url.removeprefix("http://"), network_timeout=30)
        try:
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            headers = dict(self.headers)  # tritonclient adds its own headers to the dict it is given
            out: np.ndarray = client.infer(model, [inp], headers=headers).as_numpy("OUTPUT0")
        finally:
            client.close()
        return out


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 90.0) -> float:
    """Wait for ``predicate``; returns the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
