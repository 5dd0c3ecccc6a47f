"""A replica server on free ports, in a thread with its own event loop, for the (synchronous) tritonclient."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from octacloud.protocols import ReplicaServer, ServerSettings
from octacloud.serving import ControlMode
from octacloud.serving.testing import (
    FakeRuntimeFactory,
    add_onnx,
    runtimes_with_fakes,
    write_fake_model,
    write_onnx_model,
)

T = TypeVar("T")
MAX_BODY = 256 * 1024

ADD_CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 }
parameters { key: "octacloud.max_queue_wait_us" value { string_value: "0" } }
"""
"""The protocols' tests check answers, not overload: their replica never sheds (0), however slow the machine that
runs 64 calls at once (shedding has its own tests: tests/reliability/test_replica_shedding.py)."""


class ThreadedServer:
    """Runs a :class:`ReplicaServer` on an event loop in a background thread."""

    def __init__(self, settings: ServerSettings, fakes: FakeRuntimeFactory | None = None) -> None:
        self.fakes = fakes or FakeRuntimeFactory()
        """The factory of the server's fake models (what they ran, and how many runs overlapped)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ReplicaServer(settings)
        self.call(self.server.start())

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    @property
    def http(self) -> str:
        return self.server.address

    @property
    def grpc(self) -> str:
        return self.server.grpc_address

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def build_repository(root: Path) -> Path:
    write_onnx_model(root, "add", add_onnx(), ADD_CONFIG, versions=(1, 2))
    (root / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy: { all: {} }\n")
    write_fake_model(root, "echo_bytes", "echo", datatype="TYPE_STRING", dims="2")
    write_fake_model(root, "failing", "error")
    write_fake_model(root, "slow", "slow", extra='parameters { key: "delay_ms" value { string_value: "300" } }')
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"junk")
    return root


def start(root: Path, **kw: Any) -> ThreadedServer:
    fakes = FakeRuntimeFactory()
    settings = ServerSettings(
        repository=root,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        threads=1,
        max_body_bytes=MAX_BODY,
        runtimes=runtimes_with_fakes(fakes),
        **kw,
    )
    return ThreadedServer(settings, fakes)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    s = start(build_repository(tmp_path_factory.mktemp("models")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    s = start(
        build_repository(tmp_path_factory.mktemp("models")), control_mode=ControlMode.EXPLICIT, load_models=("add",)
    )
    yield s
    s.stop()
