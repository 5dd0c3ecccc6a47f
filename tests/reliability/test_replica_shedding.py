"""A replica that sheds load (its queue is full) answers 503 / UNAVAILABLE with Retry-After, and the gateway
passes that answer on as an answer: it is no transport failure, so an overloaded replica is never ejected from
routing (which would turn a moment of overload into seconds of "no ready replica" for every client)."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.gateway.fronts import GrpcFront
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import Endpoint, Owner, RouteTable
from octacloud.serving.testing import write_fake_model

from ..protocols.conftest import ThreadedServer, start
from .harness import serve, stop

T = TypeVar("T")
METHOD = "/inference.GRPCInferenceService/ModelInfer"
# one batch at a time takes 150 ms; one more request may wait; any other is refused at once (queue full)
TIGHT = (
    'parameters { key: "delay_ms" value { string_value: "150" } }\n'
    'parameters { key: "octacloud.max_pending" value { string_value: "1" } }\n'
)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    root = tmp_path_factory.mktemp("models")
    write_fake_model(root, "tight", "slow", max_batch_size=1, extra=TIGHT)
    s = start(root)
    yield s
    s.stop()


class Front:
    """The gateway's REST and gRPC fronts without an in-flight bound of their own, on a loop in a thread."""

    def __init__(self, replica: ThreadedServer) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.limits = GatewayLimits(max_inflight_per_replica=0)
        self.routes = RouteTable()
        self.endpoint = Endpoint("r0", "127.0.0.1", replica.server.http_port, replica.server.grpc_port)
        self.routes.update("tight", [self.endpoint])
        self.routes.owners["tight"] = Owner("t")
        self.rest = RestGateway(self.routes, limits=self.limits)
        self.grpc = GrpcGateway(self.routes, limits=self.limits)
        self.http, self.http_port = self.call(serve(self.rest))
        self.server, self.grpc_port = self.call(self._grpc_server())

    async def _grpc_server(self) -> tuple[GrpcFront, int]:
        server = GrpcFront(self.grpc, self.limits)  # as octacloud up builds it
        return server, await server.start("127.0.0.1", 0, reuse_port=False)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        async def down() -> None:
            await self.server.stop(1)
            await self.grpc.close()
            await stop(self.http)
            await self.rest.pool.close()

        self.call(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def front(replica: ThreadedServer) -> Iterator[Front]:
    f = Front(replica)
    yield f
    f.close()


def message() -> bytes:
    request = pb.ModelInferRequest(model_name="tight")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones(4, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


async def grpc_calls(port: int, n: int) -> list[tuple[grpc.StatusCode, dict[str, str]]]:
    """``n`` calls at once; each one's code and trailing metadata."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD)

        async def one() -> tuple[grpc.StatusCode, dict[str, str]]:
            try:
                await call(message(), timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code(), {k: str(v) for k, v in e.trailing_metadata() or ()}
            return grpc.StatusCode.OK, {}

        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_the_replica_refuses_with_retry_after_over_grpc(replica: ThreadedServer) -> None:
    answers = asyncio.run(grpc_calls(replica.server.grpc_port, 8))
    refused = [meta for code, meta in answers if code is grpc.StatusCode.UNAVAILABLE]
    assert refused and len(refused) + sum(code is grpc.StatusCode.OK for code, _ in answers) == 8
    assert all(meta.get("retry-after") == "1" for meta in refused), refused


def http_calls(port: int, n: int) -> list[tuple[int, str | None]]:
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,1,1,1]}]}'
    out: list[tuple[int, str | None]] = []

    def one() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tight/infer", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                out.append((r.status, r.headers.get("retry-after")))
        except urllib.error.HTTPError as e:
            out.append((e.code, e.headers.get("retry-after")))
            e.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return out


def test_the_replica_refuses_with_retry_after_over_rest(replica: ThreadedServer) -> None:
    answers = http_calls(replica.server.http_port, 8)
    refused = [retry for status, retry in answers if status == 503]
    assert refused and len(answers) == 8
    assert all(retry == "1" for retry in refused), answers


def test_a_replica_that_sheds_load_stays_routed_over_grpc(front: Front) -> None:
    answers = asyncio.run(grpc_calls(front.grpc_port, 8))
    refused = [meta for code, meta in answers if code is grpc.StatusCode.UNAVAILABLE]
    assert len(refused) >= 3, answers  # enough refusals in a row to eject a replica that failed
    assert all(meta.get("retry-after") == "1" for meta in refused), refused
    assert front.endpoint.failures == 0 and front.routes.healthy("tight") == [front.endpoint]
    (code, _), = asyncio.run(grpc_calls(front.grpc_port, 1))  # fmt: skip
    assert code is grpc.StatusCode.OK


def test_a_replica_that_sheds_load_stays_routed_over_rest(front: Front) -> None:
    answers = http_calls(front.http_port, 8)
    refused = [retry for status, retry in answers if status == 503]
    assert len(refused) >= 3, answers
    assert all(retry == "1" for retry in refused), answers
    assert front.endpoint.failures == 0 and front.routes.healthy("tight") == [front.endpoint]
    assert http_calls(front.http_port, 1) == [(200, None)]
