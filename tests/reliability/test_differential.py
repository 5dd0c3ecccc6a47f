"""The same requests straight to a replica and through the gateway of a real cloud: the answers must agree
(status and body), whatever the framing — 100-continue, HEAD, chunked, pipelining, keep-alive reuse,
``Connection: close`` — and the gateway's connection to the replica must stay in step afterwards. Over gRPC
too: status, details, trailing metadata and the response's bytes, for good calls and for the replica's
refusals, many at once on one connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from octacloud.security.internal_auth import FILE_NAME, HEADER
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until
from tests.reliability.harness import complete, parse, read
from tests.security.conftest import call, make_tenant

pytestmark = pytest.mark.slow

X = (np.arange(2 * IN, dtype=np.float32).reshape(2, IN) - 7) / 5


@dataclass
class Pair:
    cloud: CloudThread
    key: str
    gateway_port: int
    replica_port: int
    secret: str
    gateway_grpc: int
    replica_grpc: int


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root: Path = tmp_path_factory.mktemp("differential")
    write_linear_model(root / "models")
    c = CloudThread(config(root, root / "models"))
    try:
        key = make_tenant(c, "a")
        assert call(c, key, "POST", "/admin/deployments", {"name": "lin", "model": "linear"}).status_code == 201
        wait_until("lin ready", lambda: bool(ready_ids(c, "lin")))
        [instance] = [i for i in c.deployment("lin")["instances"] if i["state"] == "ready"]
        secret = (root / "var" / FILE_NAME).read_text().strip()
        yield Pair(c, key, c.cloud.http_port, instance["http_port"], secret, c.cloud.grpc_port, instance["grpc_port"])
    finally:
        c.stop(stop_replicas=True)


def json_infer() -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [2, IN], "datatype": "FP32", "data": X.ravel().tolist()}]}
    ).encode()


def binary_infer() -> tuple[bytes, int]:
    head = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [2, IN], "datatype": "FP32", "parameters": {"binary_data_size": X.nbytes}}
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return head + X.tobytes(), len(head)


def auth(p: Pair, direct: bool) -> bytes:
    return f"{HEADER}: {p.secret}\r\n".encode() if direct else f"Authorization: Bearer {p.key}\r\n".encode()


async def conversation(
    port: int, steps: list[tuple[bytes, int]], continue_body: bytes = b""
) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Send each step's bytes on one connection and read that step's answers; returns every final answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got: list[tuple[int, dict[bytes, bytes], bytes]] = []
    try:
        for wire, answers in steps:
            writer.write(wire)
            if wire.startswith(b"HEAD "):  # a HEAD answer is its head alone
                head = await read(reader, lambda d: b"\r\n\r\n" in d)
                got.append((int(head.split(b" ", 2)[1]), {}, head.partition(b"\r\n\r\n")[2]))
                continue
            if continue_body and b"Expect: 100-continue" in wire:
                interim = await read(reader, lambda d: b"\r\n\r\n" in d)
                assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
                writer.write(continue_body)
            got += parse(await read(reader, complete(answers)))[0]
    finally:
        writer.close()
    return got


def normal(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return body


async def both(p: Pair, build: object) -> tuple[list[tuple[int, object]], list[tuple[int, object]]]:
    out = []
    for direct in (True, False):
        steps, cont = build(auth(p, direct))  # type: ignore[operator]
        answers = await conversation(p.replica_port if direct else p.gateway_port, steps, cont)
        out.append([(status, normal(body)) for status, _, body in answers])
    return out[0], out[1]


def post(extra: bytes, body: bytes, path: bytes = b"/v2/models/lin/infer", more: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\n%s%sContent-Length: %d\r\n\r\n%s" % (path, extra, more, len(body), body)


def get(extra: bytes, path: bytes, method: bytes = b"GET", more: bytes = b"") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: t\r\n%s%s\r\n" % (method, path, extra, more)


CASES = {
    "json infer": lambda a: ([(post(a, json_infer()), 1)], b""),
    "metadata, config, ready": lambda a: (
        [(get(a, b"/v2/models/lin") + get(a, b"/v2/models/lin/config") + get(a, b"/v2/models/lin/ready"), 3)],
        b"",
    ),
    "unknown version": lambda a: ([(post(a, json_infer(), b"/v2/models/lin/versions/7/infer"), 1)], b""),
    "malformed JSON": lambda a: ([(post(a, b'{"inputs": [}'), 1)], b""),
    "100-continue": lambda a: (
        [
            (
                post(a, b"", more=b"Expect: 100-continue\r\n").replace(
                    b"Content-Length: 0", b"Content-Length: %d" % len(json_infer())
                ),
                1,
            ),
            (post(a, json_infer()), 1),
        ],  # the next request on the connection gets its own answer
        json_infer(),
    ),
    "HEAD then GET": lambda a: ([(get(a, b"/v2/models/lin/ready", b"HEAD"), 1), (get(a, b"/v2/models/lin"), 1)], b""),
    "chunked": lambda a: (
        [
            (
                b"POST /v2/models/lin/infer HTTP/1.1\r\nHost: t\r\n"
                + a
                + b"Transfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (json_infer()[:50], json_infer()[50:]))
                + b"0\r\n\r\n",
                1,
            )
        ],
        b"",
    ),
    "pipelining": lambda a: (
        [(post(a, json_infer()) + get(a, b"/v2/models/lin/ready") + post(a, json_infer()), 3)],
        b"",
    ),
    "keep-alive reuse": lambda a: ([(post(a, json_infer()), 1) for _ in range(10)], b""),
    "connection close": lambda a: ([(post(a, json_infer(), more=b"Connection: close\r\n"), 1)], b""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_direct_and_through_the_gateway_agree(pair: Pair, case: str) -> None:
    direct, through = asyncio.run(both(pair, CASES[case]))
    assert through == direct, case
    for status, body in through:
        if case in ("json infer", "keep-alive reuse") and status == 200:
            got = np.asarray(body["outputs"][0]["data"], np.float32).reshape(2, -1)  # type: ignore[index]
            np.testing.assert_allclose(got, expected_output(X), rtol=1e-5)


def test_binary_tensors_agree(pair: Pair) -> None:
    body, header_length = binary_infer()
    more = b"Inference-Header-Content-Length: %d\r\nContent-Type: application/octet-stream\r\n" % header_length

    async def run() -> tuple[list[bytes], list[bytes]]:
        out = []
        for direct in (True, False):
            port = pair.replica_port if direct else pair.gateway_port
            answers = await conversation(port, [(post(auth(pair, direct), body, more=more), 1)])
            out.append([b for s, _, b in answers if s == 200])
        return out[0], out[1]

    direct, through = asyncio.run(run())
    assert through == direct and len(through) == 1
    assert through[0].endswith(expected_output(X).astype(np.float32).tobytes())


def test_the_connection_close_answer_closes(pair: Pair) -> None:
    async def run() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", pair.gateway_port)
        writer.write(post(auth(pair, False), json_infer(), more=b"Connection: close\r\n"))
        data = await read(reader, complete(1))
        rest = await read(reader, lambda _: False)  # the gateway closes after the answer
        writer.close()
        return data, rest

    data, rest = asyncio.run(run())
    [(status, headers, _)] = parse(data)[0]
    assert status == 200 and headers.get(b"connection") == b"close" and rest == b""


def infer_message(**changes: object) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="lin", **changes)  # type: ignore[arg-type]
    tensor = req.inputs.add(name="INPUT0", datatype="FP32", shape=[2, IN])
    tensor.contents.fp32_contents.extend(X.ravel().tolist())
    return bytes(req.SerializeToString())


def raw_infer() -> bytes:
    req = service_pb2.ModelInferRequest(model_name="lin")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[2, IN])
    req.raw_input_contents.append(X.tobytes())
    return bytes(req.SerializeToString())


def bad_shape() -> bytes:
    req = service_pb2.ModelInferRequest.FromString(infer_message())
    req.inputs[0].shape[:] = [3, IN]
    return bytes(req.SerializeToString())


GRPC_CASES = {
    "infer": ("ModelInfer", infer_message()),
    "raw infer": ("ModelInfer", raw_infer()),
    "named output": (
        "ModelInfer",
        infer_message(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="OUTPUT0")]),
    ),
    "unknown output": (
        "ModelInfer",
        infer_message(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="NOPE")]),
    ),
    "unknown version": ("ModelInfer", infer_message(model_version="7")),
    "wrong shape": ("ModelInfer", bad_shape()),
    "metadata": ("ModelMetadata", service_pb2.ModelMetadataRequest(name="lin").SerializeToString()),
    "config": ("ModelConfig", service_pb2.ModelConfigRequest(name="lin").SerializeToString()),
    "ready": ("ModelReady", service_pb2.ModelReadyRequest(name="lin").SerializeToString()),
    "ready, unknown version": (
        "ModelReady",
        service_pb2.ModelReadyRequest(name="lin", version="9").SerializeToString(),
    ),
}


def grpc_answer(channel: grpc.Channel, method: str, message: bytes, metadata: tuple[tuple[str, str], ...]) -> object:
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    try:
        response, state = call.with_call(message, metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details(), tuple(e.trailing_metadata() or ())  # type: ignore[attr-defined]
    return state.code(), state.details(), tuple(state.trailing_metadata() or ()), response


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_direct_and_through_the_gateway_agree(pair: Pair, case: str) -> None:
    method, message = GRPC_CASES[case]
    with (
        grpc.insecure_channel(f"127.0.0.1:{pair.replica_grpc}") as direct,
        grpc.insecure_channel(f"127.0.0.1:{pair.gateway_grpc}") as gateway,
    ):
        want = grpc_answer(direct, method, message, ((HEADER, pair.secret),))
        got = grpc_answer(gateway, method, message, (("authorization", f"Bearer {pair.key}"),))
    assert got == want, case
    if case in ("infer", "raw infer"):
        assert want[0] is grpc.StatusCode.OK  # type: ignore[index]
        response = service_pb2.ModelInferResponse.FromString(want[3])  # type: ignore[index]
        out = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, -1)
        np.testing.assert_allclose(out, expected_output(X), rtol=1e-5)


def test_grpc_calls_at_once_on_one_connection_each_get_their_own_answer(pair: Pair) -> None:
    """Many streams in flight on the client's connection and on the gateway's to the replica: no answer is
    another call's (the calls differ, and so do their answers). Six at a time: the gateway sheds a
    deployment's load beyond 8 in flight per replica."""
    cases = list(GRPC_CASES.values()) * 6

    async def one(
        channel: grpc.aio.Channel,
        room: asyncio.Semaphore,
        metadata: tuple[tuple[str, str], ...],
        method: str,
        body: bytes,
    ) -> object:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        async with room:
            try:
                return await call(body, metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    async def run() -> list[list[object]]:
        out: list[list[object]] = []
        for port, metadata in (
            (pair.replica_grpc, ((HEADER, pair.secret),)),
            (pair.gateway_grpc, (("authorization", f"Bearer {pair.key}"),)),
        ):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                room = asyncio.Semaphore(6)
                out.append(list(await asyncio.gather(*(one(channel, room, metadata, m, b) for m, b in cases))))
        return out

    direct, through = asyncio.run(run())
    assert through == direct
