"""The gateway's gRPC front in process, in front of two fake replicas (HTTP/2 servers with raw methods): calls
reach a replica and come back byte for byte; a replica killed mid-call (its connections dropped, no GOAWAY)
costs the caller nothing, the call is served by the other; with none left the caller gets UNAVAILABLE and
``retry-after``; a replica's own errors and trailing metadata pass through; a replica that does not answer
in time is DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import hpack
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.gateway.fronts import GrpcFront
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.routing import Endpoint, RouteTable
from octacloud.protocols.grpc import h2
from octacloud.protocols.server import new_event_loop

INFER = "/inference.GRPCInferenceService/ModelInfer"


def run(coro: Callable[[], Awaitable[None]]) -> None:
    loop = new_event_loop()
    try:
        loop.run_until_complete(coro())
    finally:
        loop.close()


class Replica:
    def __init__(self, name: str, identify: bool = False) -> None:
        """``identify``: behind the replicas' own admission (the secret, and 421's gRPC twin for calls meant for
        another replica)."""
        self.name = name
        self.seen: list[bytes] = []
        self.slow = 0  # slow calls in progress

        async def infer(message: bytes, context: h2.CallContext) -> bytes:
            self.seen.append(message)
            request = pb.ModelInferRequest.FromString(message)
            if "s" in request.parameters:
                self.slow += 1
                try:
                    await asyncio.sleep(float(request.parameters["s"].string_param))
                finally:
                    self.slow -= 1
            if request.id == "refuse":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad input é", (("x-why", "shape"),))
            assert ("x-octacloud-internal", "s" * 32) in context.invocation_metadata()
            assert all(k != "authorization" for k, _ in context.invocation_metadata())
            return pb.ModelInferResponse(
                model_name=request.model_name, id=f"{self.name}:{request.id}"
            ).SerializeToString()

        admit = h2.require_secret(b"s" * 32, name) if identify else None
        self.server = h2.Http2Server({INFER: h2.Method(None, infer, streaming=False)}, admit=admit)
        self.port = 0

    async def start(self) -> None:
        self.port = await self.server.start("127.0.0.1", 0)

    async def kill(self) -> None:
        """As kill -9 would: connections dropped without a word, the port closed."""
        for c in list(self.server.connections):
            if c._transport is not None:
                c._transport.abort()
        await self.server.stop(0)


def request(rid: str, seconds: float = 0.0) -> bytes:
    req = pb.ModelInferRequest(model_name="lin", id=rid)
    if seconds:
        req.parameters["s"].string_param = str(seconds)
    return bytes(req.SerializeToString())


async def setup(
    timeout: float = 60.0, bound: int = 0, identify: bool = False
) -> tuple[GrpcFront, int, list[Replica], RouteTable]:
    replicas = [Replica("a", identify), Replica("b", identify)]
    for r in replicas:
        await r.start()
    routes = RouteTable()
    routes.update("lin", [Endpoint(r.name, "127.0.0.1", 1, r.port) for r in replicas])
    limits = GatewayLimits(max_inflight_per_replica=bound)
    front = GrpcFront(GrpcGateway(routes, timeout=timeout, limits=limits, internal_secret="s" * 32), limits)
    port = await front.start("127.0.0.1", 0, reuse_port=False)
    return front, port, replicas, routes


async def busy(*replicas: Replica) -> None:
    """Wait (up to 2 s) until every one of ``replicas`` holds a slow call."""
    for _ in range(200):
        if all(r.slow for r in replicas):
            return
        await asyncio.sleep(0.01)


async def call(channel: grpc.aio.Channel, message: bytes) -> pb.ModelInferResponse | tuple[object, ...]:
    try:
        raw = await channel.unary_unary(INFER)(message, metadata=(("authorization", "Bearer x"),), timeout=10)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), tuple(e.trailing_metadata() or ())
    return pb.ModelInferResponse.FromString(raw)


def test_calls_go_through_and_a_replica_killed_mid_call_costs_nothing() -> None:
    async def go() -> None:
        front, port, (a, b), _ = await setup()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                answers = await asyncio.gather(*(call(channel, request(str(i))) for i in range(20)))
                assert sorted(x.id.split(":")[1] for x in answers) == sorted(str(i) for i in range(20))  # type: ignore[union-attr]
                assert a.seen and b.seen  # both replicas served
                # calls in flight on both when a dies: those on a are served again by b
                pending = [asyncio.ensure_future(call(channel, request(f"s{i}", 0.5))) for i in range(6)]
                await busy(a, b)
                assert a.slow and b.slow
                await a.kill()
                done = await asyncio.gather(*pending)
                assert all(isinstance(x, pb.ModelInferResponse) and x.id.startswith("b:") for x in done), done
                # none left: UNAVAILABLE, with retry-after
                await b.kill()
                code, details, trailing = await call(channel, request("z"))  # type: ignore[misc]
                assert code is grpc.StatusCode.UNAVAILABLE, details
                assert any(k == "retry-after" for k, _ in trailing)
        finally:
            await front.stop(0.5)

    run(go)


def test_replica_errors_pass_through_and_slow_replicas_time_out() -> None:
    async def go() -> None:
        front, port, replicas, routes = await setup(timeout=0.3)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                code, details, trailing = await call(channel, request("refuse"))  # type: ignore[misc]
                assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "bad input é")
                assert ("x-why", "shape") in trailing
                code, details, _ = await call(channel, request("late", 1.0))  # type: ignore[misc]
                assert code is grpc.StatusCode.DEADLINE_EXCEEDED, details
                answer = await call(channel, request("after"))
                assert isinstance(answer, pb.ModelInferResponse)  # the connections still serve
                assert routes.counter("lin").outstanding == 0
        finally:
            await front.stop(0.5)
            for r in replicas:
                await r.server.stop(0)

    run(go)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos : pos + 3], "big")
        out.append(
            (data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big"), data[pos + 9 : pos + 9 + n])
        )
        pos += 9 + n
    return out


def _call_frames(stream: int, message: bytes, encoder: hpack.Encoder) -> bytes:
    block = encoder.encode(
        [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers"), ("authorization", "Bearer x")]
    )  # fmt: skip
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return _frame(h2.HEADERS, h2.END_HEADERS, stream, block) + _frame(h2.DATA, h2.END_STREAM, stream, body)


def test_a_call_over_the_in_flight_bound_gets_one_trailers_only_frame_and_never_reaches_a_replica() -> None:
    """Both replicas' slots (one each) are held by slow calls: the next call is refused in the frame handling,
    UNAVAILABLE with ``retry-after: 1`` in a single HEADERS frame ending the stream, the method never called,
    not billed; once the slow calls end (or their client goes away) the slots are free again."""

    async def go() -> None:
        front, port, replicas, routes = await setup(bound=1)
        method = front.server.methods[INFER]
        called: list[bytes] = []

        async def spy(message: bytes, context: h2.CallContext) -> bytes:
            called.append(message)
            out: bytes = await method.call(message, context)
            return out

        front.server.methods[INFER] = h2.Method(None, spy, streaming=False)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                slow = [asyncio.ensure_future(call(channel, request(f"s{i}", 0.5))) for i in range(2)]
                await busy(*replicas)
                assert all(r.slow for r in replicas) and routes.counter("lin").outstanding == 2
                seen, billed = sum(len(r.seen) for r in replicas), dict(routes.traffic)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _call_frames(1, request("over"), hpack.Encoder()))
                got = b""
                async with asyncio.timeout(5):
                    while not any(k == h2.HEADERS and s == 1 for k, _, s, _ in _frames(got)):
                        got += await reader.read(65536)
                answer = [(k, f, p) for k, f, s, p in _frames(got) if s == 1]
                assert len(answer) == 1, answer  # trailers-only: no DATA, no second HEADERS
                kind, flags, payload = answer[0]
                assert kind == h2.HEADERS and flags & h2.END_STREAM and flags & h2.END_HEADERS
                headers = dict(hpack.Decoder().decode(payload))
                assert headers[":status"] == "200" and headers["content-type"] == "application/grpc"
                assert headers["grpc-status"] == "14" and headers["retry-after"] == "1"
                assert "at capacity" in headers["grpc-message"]
                assert len(called) == 2  # the slow ones: the refused call never reached the method
                assert sum(len(r.seen) for r in replicas) == seen and routes.counter("lin").shed == 1
                assert dict(routes.traffic) == billed  # a refusal is not billed
                assert all(isinstance(x, pb.ModelInferResponse) for x in await asyncio.gather(*slow))
                assert routes.counter("lin").outstanding == 0
                # a gated call whose client vanishes at once still gives its slot back
                writer.write(_call_frames(3, request("gone", 0.3), hpack.Encoder()))
                await writer.drain()
                writer.transport.abort()
                for _ in range(100):
                    if routes.counter("lin").outstanding == 0:
                        break
                    await asyncio.sleep(0.01)
                assert routes.counter("lin").outstanding == 0
                assert isinstance(await call(channel, request("after")), pb.ModelInferResponse)
        finally:
            await front.stop(0.5)
            for r in replicas:
                await r.server.stop(0)

    run(go)


def test_two_tenants_on_one_connection_each_reach_the_replica_as_themselves(tmp_path: Path) -> None:
    """Calls of two tenants, interleaved on one connection with repeated metadata (the gateway reads a repeated
    header block once and encodes the forwarded metadata once per caller): every call reaches the replica with
    its own verified tenant and never a client's claim; a key revoked between calls is refused at once."""
    from sqlalchemy import create_engine

    from octacloud.core.clock import ManualClock
    from octacloud.gateway.routing import Owner
    from octacloud.tenancy import Guard
    from octacloud.tenancy.keys import KeyStore, Role

    keys = KeyStore(create_engine(f"sqlite:///{tmp_path / 'keys.db'}"), b"k" * 32, ManualClock(), cache_s=0.0)
    secrets = {}
    for tenant in ("alice", "bob"):
        keys.create_tenant(tenant)
        info, secrets[tenant] = keys.create_key(tenant, Role.TENANT)
        if tenant == "bob":
            bob_key = info.id

    async def go() -> None:
        seen: list[str] = []

        async def infer(message: bytes, context: h2.CallContext) -> bytes:
            [tenant] = [v for k, v in context.invocation_metadata() if k == "x-octacloud-tenant"]
            seen.append(str(tenant))
            return message

        replica = h2.Http2Server({INFER: h2.Method(None, infer, streaming=False)})
        port = await replica.start("127.0.0.1", 0)
        routes = RouteTable()
        routes.update("lin", [Endpoint("r", "127.0.0.1", 1, port)])
        routes.owners["lin"] = Owner("alice", published=True)
        limits = GatewayLimits(max_inflight_per_replica=0)
        front = GrpcFront(GrpcGateway(routes, guard=Guard(keys), limits=limits, internal_secret="s" * 32), limits)
        gw = await front.start("127.0.0.1", 0, reuse_port=False)
        try:
            sent: list[str] = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw}") as channel:
                infer_call = channel.unary_unary(INFER)
                for i in range(30):
                    tenant = "alice" if i % 3 else "bob"
                    metadata = (("authorization", f"Bearer {secrets[tenant]}"), ("x-octacloud-tenant", "alice"))
                    assert await infer_call(request(str(i)), metadata=metadata, timeout=5) == request(str(i))
                    sent.append(tenant)
                assert seen == sent
                keys.revoke_key(bob_key)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await infer_call(request("x"), metadata=(("authorization", f"Bearer {secrets['bob']}"),), timeout=5)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert len(seen) == 30
        finally:
            await front.stop(0.5)
            await replica.stop(0.5)

    run(go)


def test_a_replica_address_taken_by_another_replica_is_retried_not_answered_from() -> None:
    """Replica a is gone and b listens where a's route points: b refuses what was meant for a (UNAVAILABLE, naming
    itself), the gateway tries the next replica, and every call is answered by the replica it was sent to."""

    async def go() -> None:
        front, port, (a, b), routes = await setup(identify=True)
        try:
            await a.kill()
            routes.now = lambda: 0.0  # an ejection lasts while the test runs, however slow the machine
            routes.update("lin", [Endpoint("a", "127.0.0.1", 1, b.port), Endpoint("b", "127.0.0.1", 1, b.port)])
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                # the choice between a and b is random: call until a has failed often enough to be ejected
                answers: list[pb.ModelInferResponse | tuple[object, ...]] = []
                while len(answers) < 100 and len(routes.healthy("lin")) == 2:
                    answers.append(await call(channel, request(str(len(answers)))))
                assert all(isinstance(x, pb.ModelInferResponse) and x.id.startswith("b:") for x in answers), answers
                assert len(b.seen) == len(answers) and a.seen == []
                assert [e.replica_id for e in routes.healthy("lin")] == ["b"]  # the stale route is ejected
                routes.update("lin", [Endpoint("a", "127.0.0.1", 1, b.port)])  # only the stale route is left
                code, details, trailing = await call(channel, request("z"))  # type: ignore[misc]
                assert code is grpc.StatusCode.UNAVAILABLE and str(b.port) not in details, details
                assert any(k == "retry-after" for k, _ in trailing)
                assert len(b.seen) == len(answers)
        finally:
            await front.stop(0.5)
            await b.kill()

    run(go)


def test_a_replica_dropped_on_purpose_answers_its_calls_in_flight_and_one_found_dead_does_not() -> None:
    """Scale-down, move, rollout drop a replica from the routes while it still runs: the calls it holds are
    answered by it (not cut and computed again elsewhere). A replica the controller found dead is dropped as
    gone: its calls in flight go to the other replica at once."""

    async def go() -> None:
        front, port, (a, b), routes = await setup()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                pending = [asyncio.ensure_future(call(channel, request(f"s{i}", 0.5))) for i in range(6)]
                await busy(a, b)
                held = a.slow
                assert held and b.slow
                routes.drop_endpoint("a")  # stopped on purpose: it drains
                done = await asyncio.gather(*pending)
                assert all(isinstance(x, pb.ModelInferResponse) for x in done), done
                assert sum(x.id.startswith("a:") for x in done) == held  # type: ignore[union-attr]
                assert len(a.seen) == held  # none computed twice

                routes.update("lin", [Endpoint("a", "127.0.0.1", 1, a.port), Endpoint("b", "127.0.0.1", 1, b.port)])
                pending = [asyncio.ensure_future(call(channel, request(f"t{i}", 2.0))) for i in range(6)]
                await busy(a, b)
                assert a.slow and b.slow
                loop = asyncio.get_running_loop()
                started = loop.time()
                routes.drop_endpoint("a", gone=True)  # found dead (here it still runs: only the gateway reacts)
                done = await asyncio.gather(*pending)
                assert all(isinstance(x, pb.ModelInferResponse) and x.id.startswith("b:") for x in done), done
                assert loop.time() - started < 3.9  # retried at once on b (2 s), not after a's answer (2 s) plus b's
        finally:
            await a.kill()
            await b.kill()
            await front.stop(0.5)

    run(go)
