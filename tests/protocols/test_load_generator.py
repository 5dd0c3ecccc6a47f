"""bench/openloop.py, the load generator of bench/knee.py: its HTTP/2 framing works against the replica's own
gRPC server (protocols/grpc/h2.py) and the gateway's gRPC front, its HTTP/1.1 against both REST fronts, and
what is refused (load shed) is counted as refused, with its Retry-After, apart from real errors. Counts only:
nothing here is timed."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar, cast

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.gateway.fronts import GrpcFront
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import Endpoint, Owner, RouteTable
from octacloud.protocols.internal import HEADER

from ..reliability.harness import serve, stop
from .conftest import ThreadedServer, build_repository, start

T = TypeVar("T")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "openloop.py"
SECRET = "k" * 43


def _openloop() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openloop", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["openloop"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ol = _openloop()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    root = tmp_path_factory.mktemp("models")
    secret = root.parent / "internal.secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    s = start(build_repository(root), internal_secret_file=secret)
    yield s
    s.stop()


class LoopThread:
    """An event loop in a thread, for the gateway's servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def gateway(replica: ThreadedServer) -> Iterator[tuple[int, int]]:
    """The gateway's REST and gRPC fronts (as ``octacloud up`` builds them) in front of the replica, with an
    in-flight bound of one request per replica: anything more at once is refused."""
    limits = GatewayLimits(max_inflight_per_replica=1)
    routes = RouteTable()
    endpoint = Endpoint("r0", "127.0.0.1", replica.server.http_port, replica.server.grpc_port)
    for model in ("add", "slow"):
        routes.update(model, [endpoint])
        routes.owners[model] = Owner("t")
    loop = LoopThread()
    rest = RestGateway(routes, limits=limits, internal_secret=SECRET)
    grpc_front = GrpcGateway(routes, limits=limits, internal_secret=SECRET)

    async def up() -> tuple[Any, GrpcFront, int, int]:
        http, http_port = await serve(rest)
        server = GrpcFront(grpc_front, limits)
        grpc_port = await server.start("127.0.0.1", 0, reuse_port=False)
        return http, server, http_port, grpc_port

    http, server, http_port, grpc_port = loop.call(up())
    yield http_port, grpc_port

    async def down() -> None:
        await server.stop(1)
        await grpc_front.close()
        await stop(http)
        await rest.pool.close()

    loop.call(down())
    loop.close()


def add_message(model: str = "add") -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def slow_message() -> bytes:
    request = pb.ModelInferRequest(model_name="slow")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones(4, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def http_add(headers: tuple[tuple[str, str], ...], model: str = "add") -> bytes:
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},'
    body += b'{"name":"INPUT1","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def closed(target: Any, concurrency: int, seconds: float = 0.6) -> Any:
    plan = ol.Plan(target, time.monotonic() + 0.2, seconds, warmup_s=0.0, concurrency=concurrency, preopen=2)
    return ol.run_worker(plan)


def opened(target: Any, rate: float, seconds: float = 0.6) -> Any:
    plan = ol.Plan(target, time.monotonic() + 0.2, seconds, warmup_s=0.0, rate=rate, preopen=2)
    return ol.run_worker(plan)


INTERNAL = ((HEADER, SECRET),)


def test_grpc_calls_over_its_http2_framing_are_answered_by_the_replica(replica: ThreadedServer) -> None:
    target = ol.Target("grpc", "127.0.0.1", replica.server.grpc_port, add_message(), INTERNAL)
    r = closed(target, concurrency=8)
    assert r.sent > 8 and len(r.ok) == r.sent, r.summary()
    assert not r.errors and not r.refused
    assert set(r.codes) == {"grpc-0"}
    assert r.connections == 2  # eight calls at a time are streams of its two connections
    r = opened(target, rate=300)
    assert len(r.ok) == r.sent > 0 and not r.errors, r.summary()


def test_grpc_metadata_is_sent_and_an_error_is_no_refusal(replica: ThreadedServer) -> None:
    """Without the internal secret the replica answers UNAUTHENTICATED; an unknown model NOT_FOUND: errors,
    by their code, not refusals (the metadata the generator sends is what the server reads)."""
    no_secret = ol.Target("grpc", "127.0.0.1", replica.server.grpc_port, add_message())
    r = closed(no_secret, concurrency=2)
    assert r.sent > 0 and not r.ok and not r.refused
    assert set(r.errors) == {"grpc-16"} and r.errors["grpc-16"] == r.sent
    unknown = ol.Target("grpc", "127.0.0.1", replica.server.grpc_port, add_message("nope"), INTERNAL)
    r = closed(unknown, concurrency=2)
    assert set(r.errors) == {"grpc-5"} and not r.refused


def test_http_requests_are_answered_by_the_replica(replica: ThreadedServer) -> None:
    target = ol.Target("http", "127.0.0.1", replica.server.http_port, http_add(INTERNAL), INTERNAL)
    r = closed(target, concurrency=4)
    assert r.sent > 4 and len(r.ok) == r.sent and set(r.codes) == {"200"}, r.summary()
    r = closed(ol.Target("http", "127.0.0.1", replica.server.http_port, http_add(())), concurrency=1)
    assert not r.ok and set(r.errors) == {"401"}, r.summary()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_through_the_gateway_refusals_are_counted_as_refused_with_retry_after(
    gateway: tuple[int, int], protocol: str
) -> None:
    """The slow model (200 ms a batch) behind a gateway that admits one request at a time: of eight calls kept
    in flight, seven are refused at once (503 / UNAVAILABLE with Retry-After), one is admitted."""
    http_port, grpc_port = gateway
    if protocol == "grpc":
        target = ol.Target("grpc", "127.0.0.1", grpc_port, slow_message())
    else:
        body = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,1,1,1]}]}'
        head = f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        target = ol.Target("http", "127.0.0.1", http_port, head + body)
    r = closed(target, concurrency=8, seconds=0.7)
    assert r.ok, r.summary()
    assert len(r.refused) > 10 * len(r.ok), r.summary()
    assert r.refused_with_retry_after == len(r.refused)
    assert not r.errors, r.summary()
    expected = {"grpc-0", "grpc-14"} if protocol == "grpc" else {"200", "503"}
    assert set(r.codes) == expected


def test_through_the_gateway_the_answers_are_those_of_the_replica(gateway: tuple[int, int]) -> None:
    http_port, grpc_port = gateway
    r = closed(ol.Target("grpc", "127.0.0.1", grpc_port, add_message()), concurrency=1)
    assert len(r.ok) == r.sent > 0 and not r.errors, r.summary()
    r = closed(ol.Target("http", "127.0.0.1", http_port, http_add(())), concurrency=1)
    assert len(r.ok) == r.sent > 0 and not r.errors, r.summary()


def test_several_processes_share_one_schedule(replica: ThreadedServer) -> None:
    """run_load: worker processes, each its share of the rate, results merged (the wire between them)."""
    target = ol.Target("grpc", "127.0.0.1", replica.server.grpc_port, add_message(), INTERNAL)
    r = ol.run_load(target, seconds=0.8, rate=400, procs=2, warmup_s=0.2)
    assert r.sent > 0 and len(r.ok) == r.sent and not r.errors, r.summary()
    assert r.connections == 4 and r.sent_all >= r.sent  # two gRPC connections per worker
    assert r.summary()["ok_per_s"] > 0


class RefusingHttp2(asyncio.Protocol):
    """An HTTP/2 server that refuses every stream with RST_STREAM REFUSED_STREAM (grpc's overload guard)."""

    open: ClassVar[set[asyncio.Transport]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.open.add(self.transport)
        self.buf = b""
        window = ol._frame(ol.WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65535).to_bytes(4, "big"))
        self.transport.write(ol._frame(ol.SETTINGS, 0, 0) + window)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.buf.startswith(ol.PREFACE):
            self.buf = self.buf[len(ol.PREFACE) :]
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                return
            kind, sid = self.buf[3], int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            self.buf = self.buf[9 + length :]
            if kind == ol.HEADERS:
                self.transport.write(ol._frame(ol.RST_STREAM, 0, sid, (7).to_bytes(4, "big")))


def test_a_stream_refused_by_http2_itself_is_counted_as_refused_without_retry_after() -> None:
    loop = LoopThread()

    async def up() -> asyncio.Server:
        return await asyncio.get_running_loop().create_server(RefusingHttp2, "127.0.0.1", 0)

    server = loop.call(up())
    try:
        port = server.sockets[0].getsockname()[1]
        r = closed(ol.Target("grpc", "127.0.0.1", port, add_message()), concurrency=2, seconds=0.3)
        assert r.sent > 0 and len(r.refused) == r.sent and not r.errors and not r.ok, r.summary()
        assert r.refused_with_retry_after == 0 and set(r.codes) == {"grpc-refused-stream"}
    finally:

        async def down() -> None:
            server.close()
            for t in RefusingHttp2.open:
                t.close()
            await server.wait_closed()
            await asyncio.sleep(0.01)

        loop.call(down())
        loop.close()
