"""octacloud's own HTTP/2 gRPC server (protocols/grpc/h2.py) on uvloop, as ``octacloud serve`` runs it: real
grpc clients, flow control past the default windows, and clients that misbehave or vanish mid-call."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from octacloud.protocols import ReplicaServer
from octacloud.protocols.grpc import h2
from octacloud.protocols.server import new_event_loop

from .conftest import ThreadedServer, build_repository, start


class UvloopServer(ThreadedServer):
    """The conftest's threaded server, on the loop ``octacloud serve`` uses."""

    def __init__(self, inner: ThreadedServer) -> None:
        settings = inner.server.settings
        inner.stop()
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ReplicaServer(settings)
        self.call(self.server.start())


@pytest.fixture(scope="module")
def uv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvloopServer]:
    s = UvloopServer(start(build_repository(tmp_path_factory.mktemp("models"))))
    yield s
    s.stop()


def _add_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = [
        grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
        grpcclient.InferInput("INPUT1", list(b.shape), "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_it_is_the_h2_server(uv: UvloopServer) -> None:
    assert uv.server.settings.grpc_server == "h2"
    assert uv.server._grpc is None and uv.server._grpc_h2 is not None


def test_concurrent_calls_on_one_connection_each_get_their_own_answer(uv: UvloopServer) -> None:
    async def go() -> None:
        async with aioclient.InferenceServerClient(uv.grpc) as client:
            xs = [np.full((1, 4), i, np.float32) for i in range(64)]

            async def one(x: np.ndarray) -> np.ndarray:
                r = await client.infer("add", _add_inputs(x, x), model_version="1")
                out: np.ndarray = r.as_numpy("OUTPUT0")
                return out

            outs = await asyncio.gather(*(one(x) for x in xs))
            for x, out in zip(xs, outs, strict=True):
                np.testing.assert_allclose(out, x + x)

    asyncio.run(go())


def test_messages_larger_than_the_flow_control_windows(uv: UvloopServer) -> None:
    # 2 x 90 KB strings: the request and the response each exceed HTTP/2's default 64 KiB windows
    client = grpcclient.InferenceServerClient(uv.grpc)
    data = np.array([[b"a" * 90_000, b"b" * 90_000]], dtype=object)
    i = grpcclient.InferInput("INPUT0", [1, 2], "BYTES")
    i.set_data_from_numpy(data)
    for _ in range(3):
        out = client.infer("echo_bytes", [i]).as_numpy("OUTPUT0")
        assert out.tolist() == data.tolist()
    client.close()


def test_unknown_method_is_unimplemented_and_errors_keep_their_code(uv: UvloopServer) -> None:
    with grpc.insecure_channel(uv.grpc) as channel:
        nope = channel.unary_unary("/inference.GRPCInferenceService/Nope")
        with pytest.raises(grpc.RpcError) as e:
            nope(b"")
        assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    client = grpcclient.InferenceServerClient(uv.grpc)
    with pytest.raises(InferenceServerException) as err:
        client.infer("nosuch", _add_inputs(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)))
    assert "StatusCode.NOT_FOUND" in str(err.value.status())
    assert "nosuch" in err.value.message()
    client.close()


def test_a_client_past_its_deadline_leaves_the_server_serving(uv: UvloopServer) -> None:
    client = grpcclient.InferenceServerClient(uv.grpc)
    i = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    i.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("slow", [i], client_timeout=0.05)
    assert "DEADLINE_EXCEEDED" in str(err.value.status())
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(client.infer("add", _add_inputs(x, x)).as_numpy("OUTPUT0"), 2 * x)
    client.close()


# ---- raw HTTP/2 clients -----------------------------------------------------------------------------------


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _read_until_closed(s: socket.socket, seconds: float = 5) -> bytes:
    s.settimeout(seconds)
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return got
        if not chunk:
            return got
        got += chunk


def _call_frames(path: str, message: bytes, stream: int = 1) -> bytes:
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return _frame(h2.HEADERS, h2.END_HEADERS, stream, block) + _frame(h2.DATA, h2.END_STREAM, stream, body)


def _assert_serving(uv: UvloopServer) -> None:
    client = grpcclient.InferenceServerClient(uv.grpc)
    assert client.is_server_live()
    client.close()


def test_a_client_that_does_not_speak_http2_is_closed(uv: UvloopServer) -> None:
    s = _connect(uv.grpc)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"HTTP" not in _read_until_closed(s)  # closed without an answer
    s.close()
    _assert_serving(uv)


def test_an_oversized_frame_gets_goaway_frame_size_error(uv: UvloopServer) -> None:
    s = _connect(uv.grpc)
    s.sendall(h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + struct.pack(">I", 2**20)[1:] + b"\x00\x00\x00\x00\x00\x01")
    got = _read_until_closed(s)
    s.close()
    goaway = got.find(bytes((h2.GOAWAY,)) + b"\x00\x00\x00\x00\x00")
    assert goaway >= 3
    code = struct.unpack(">I", got[goaway + 6 + 4 : goaway + 6 + 8])[0]
    assert code == h2.FRAME_SIZE_ERROR
    _assert_serving(uv)


def test_a_raw_unary_call_gets_headers_data_and_trailers_in_one_answer(uv: UvloopServer) -> None:
    s = _connect(uv.grpc)
    request = pb.ServerLiveRequest().SerializeToString()
    s.sendall(
        h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _call_frames("/inference.GRPCInferenceService/ServerLive", request)
    )
    s.settimeout(5)
    got, frames = b"", list[tuple[int, int, int, bytes]]()
    decoder = hpack.Decoder()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(k == h2.HEADERS and f & h2.END_STREAM for k, f, _, _ in frames):
        got += s.recv(65536)
        frames, rest = [], got
        while len(rest) >= 9 and len(rest) >= 9 + int.from_bytes(rest[:3], "big"):
            n = int.from_bytes(rest[:3], "big")
            frames.append((rest[3], rest[4], int.from_bytes(rest[5:9], "big"), rest[9 : 9 + n]))
            rest = rest[9 + n :]
    s.close()
    ours = [(k, f, p) for k, f, sid, p in frames if sid == 1]
    assert [k for k, _, _ in ours] == [h2.HEADERS, h2.DATA, h2.HEADERS]
    assert dict(decoder.decode(ours[0][2], raw=True))[b":status"] == b"200"
    assert pb.ServerLiveResponse.FromString(ours[1][2][5:]).live
    assert dict(decoder.decode(ours[2][2], raw=True))[b"grpc-status"] == b"0"


def test_a_client_that_vanishes_mid_call_leaves_nothing_behind(uv: UvloopServer) -> None:
    request = pb.ModelInferRequest(model_name="slow")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    t.contents.fp32_contents.extend([0.0] * 4)
    for _ in range(3):  # the call is in flight (the model sleeps 300 ms) when the socket goes away
        s = _connect(uv.grpc)
        frames = _call_frames("/inference.GRPCInferenceService/ModelInfer", request.SerializeToString())
        s.sendall(h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + frames)
        time.sleep(0.05)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, as after kill -9
        s.close()
    _assert_serving(uv)
    assert uv.server._grpc_h2 is not None
    deadline = time.monotonic() + 30  # against a hang: the three calls end one after the other, then their connections
    while uv.server._grpc_h2.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not uv.server._grpc_h2.connections


def test_the_aio_server_is_still_available(tmp_path: Path) -> None:
    s = start(build_repository(tmp_path), grpc_server="aio")
    try:
        assert s.server._grpc is not None
        client = grpcclient.InferenceServerClient(s.grpc)
        x = np.ones((1, 4), np.float32)
        np.testing.assert_allclose(client.infer("add", _add_inputs(x, x)).as_numpy("OUTPUT0"), 2 * x)
        client.close()
    finally:
        s.stop()


def test_trailing_metadata_and_codes_reach_a_grpc_client() -> None:
    async def limited(request: bytes, context: h2.CallContext) -> pb.ServerLiveResponse:
        assert ("authorization", "Bearer k") in context.invocation_metadata()
        context.set_trailing_metadata([("retry-after", "2")])
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the rate: retry in 2 s")
        raise AssertionError("unreachable")

    async def fine(request: bytes, context: h2.CallContext) -> pb.ServerLiveResponse:
        context.set_trailing_metadata([("x-served-by", "replica-1"), ("x-blob-bin", b"\x00\x01")])
        return pb.ServerLiveResponse(live=True)

    async def go() -> None:
        extra = {
            "/t.T/Limited": h2.Method(bytes, limited, streaming=False),
            "/t.T/Fine": h2.Method(bytes, fine, streaming=False),
        }
        server = h2.GrpcServer(cast(Any, None), extra=extra)
        port = await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/t.T/Limited")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"", metadata=(("authorization", "Bearer k"),))
                assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert e.value.details() == "over the rate: retry in 2 s"
                assert ("retry-after", "2") in tuple(e.value.trailing_metadata() or ())
                ok = channel.unary_unary("/t.T/Fine", response_deserializer=pb.ServerLiveResponse.FromString)
                c = ok(b"")
                assert (await c).live
                trailing = tuple(await c.trailing_metadata())
                assert ("x-served-by", "replica-1") in trailing and ("x-blob-bin", b"\x00\x01") in trailing
        finally:
            await server.stop(1)

    asyncio.run(go())
