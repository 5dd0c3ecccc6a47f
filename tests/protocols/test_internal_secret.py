"""A replica launched by a cloud answers only requests that carry the cloud's internal secret."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from octacloud.core.errors import InvalidSpecError
from octacloud.protocols import ServerSettings
from octacloud.protocols.internal import ENV_VAR, HEADER, REPLICA_HEADER, REPLICA_ID_ENV

from .conftest import ThreadedServer, build_repository, start

SECRET = "s" * 40


def secret_file(tmp: Path, mode: int = 0o600) -> Path:
    path = tmp / "internal.secret"
    path.write_text(SECRET + "\n")
    os.chmod(path, mode)
    return path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    tmp = tmp_path_factory.mktemp("guarded")
    s = start(build_repository(tmp / "models"), internal_secret_file=secret_file(tmp))
    yield s
    s.stop()


def get(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


INFER = (
    b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]},'
    b'{"name":"INPUT1","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2", None),
        ("/v2/models/add", None),
        ("/v2/models/add/infer", INFER),
        ("/v2/models/stats", None),
        ("/v2/repository/index", b"{}"),
        ("/v2/repository/models/add/unload", b"{}"),
    ],
)
def test_rest_needs_the_secret(guarded: ThreadedServer, path: str, body: bytes | None) -> None:
    url = f"http://{guarded.http}{path}"
    assert get(url, body=body) == 401
    assert get(url, {HEADER: "s" * 39 + "x"}, body) == 401
    assert get(url, {HEADER: SECRET}, body) in (200, 403)  # 403: unload in control mode none
    assert get(f"http://{guarded.http}/v2/health/ready") == 200  # health stays open


def test_an_inference_without_the_secret_is_refused_before_its_body_arrives(guarded: ThreadedServer) -> None:
    """The refusal comes from the headers alone: the client announces a body and never sends it, and still gets
    its 401 at once, with the connection closed (its unread body cannot be mistaken for the next request)."""
    host, port = guarded.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 401 ") and b"connection: close" in got.lower()


def test_metrics_need_the_secret(guarded: ThreadedServer) -> None:
    url = f"http://127.0.0.1:{guarded.server.metrics_port}/metrics"
    assert get(url) == 401
    assert get(url, {HEADER: "nope"}) == 401
    assert get(url, {HEADER: SECRET}) == 200


def test_grpc_needs_the_secret(guarded: ThreadedServer) -> None:
    with grpc.insecure_channel(guarded.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest()).live  # health stays open
        request = pb.ModelInferRequest(model_name="add")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(np.ones(4, np.float32).tobytes())
        calls = [
            lambda md: stub.ModelMetadata(pb.ModelMetadataRequest(name="add"), metadata=md),
            lambda md: stub.ModelInfer(request, metadata=md),
            lambda md: stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="add"), metadata=md),
            lambda md: list(stub.ModelStreamInfer(iter([request]), metadata=md)),
        ]
        for call in calls:
            for md in ((), ((HEADER, "wrong"),)):
                with pytest.raises(grpc.RpcError) as e:
                    call(md)
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert stub.ModelMetadata(pb.ModelMetadataRequest(name="add"), metadata=((HEADER, SECRET),)).name == "add"
        out = stub.ModelInfer(request, metadata=((HEADER, SECRET),))
        assert np.frombuffer(out.raw_output_contents[0], np.float32).tolist() == [2, 2, 2, 2]


def test_the_secret_comes_from_the_environment_and_a_readable_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = secret_file(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(path))
    assert ServerSettings(repository=tmp_path).internal_secret_file == path
    monkeypatch.delenv(ENV_VAR)
    assert ServerSettings(repository=tmp_path).internal_secret_file is None
    from octacloud.protocols.server import ReplicaServer

    os.chmod(path, 0o644)
    with pytest.raises(InvalidSpecError, match="readable by others"):
        ReplicaServer(ServerSettings(repository=tmp_path, internal_secret_file=path))


def test_a_replica_of_a_cloud_never_binds_every_interface(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    for wildcard in ("0.0.0.0", "::"):
        assert ServerSettings(repository=tmp_path, host=wildcard, internal_secret_file=path).host == "127.0.0.1"
    assert ServerSettings(repository=tmp_path, host="10.1.2.3", internal_secret_file=path).host == "10.1.2.3"
    assert ServerSettings(repository=tmp_path, host="0.0.0.0", internal_secret_file=None).host == "0.0.0.0"


@pytest.fixture(scope="module", params=["h2", "aio"])
def named(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    tmp = tmp_path_factory.mktemp("named")
    s = start(
        build_repository(tmp / "models"),
        internal_secret_file=secret_file(tmp),
        replica_id="r1",
        grpc_server=request.param,
    )
    yield s
    s.stop()


def answer(url: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


@pytest.mark.parametrize(("path", "body"), [("/v2/models/add/infer", INFER), ("/v2/models/add/ready", None)])
def test_a_request_meant_for_another_replica_is_misdirected(
    named: ThreadedServer, path: str, body: bytes | None
) -> None:
    """A process that took a dead replica's port refuses what was meant for that replica (421), naming itself."""
    url = f"http://{named.http}{path}"
    status, text = answer(url, {HEADER: SECRET, REPLICA_HEADER: "r0"}, body)
    assert status == 421, text
    assert "'r1'" in text and "'r0'" in text and "out of date" in text
    assert answer(url, {HEADER: SECRET, REPLICA_HEADER: "r1"}, body)[0] == 200  # meant for this one
    assert answer(url, {HEADER: SECRET}, body)[0] == 200  # names no replica: a direct caller with the secret
    assert answer(url, {REPLICA_HEADER: "r1"}, body)[0] == 401  # naming the replica is no key
    assert answer(f"http://{named.http}/v2/health/ready", {REPLICA_HEADER: "r0"})[0] == 421
    assert answer(f"http://{named.http}/v2/health/ready", {})[0] == 200


def test_metrics_meant_for_another_replica_are_misdirected(named: ThreadedServer) -> None:
    url = f"http://127.0.0.1:{named.server.metrics_port}/metrics"
    status, text = answer(url, {HEADER: SECRET, REPLICA_HEADER: "r0"})
    assert status == 421 and "'r1'" in text
    assert answer(url, {HEADER: SECRET, REPLICA_HEADER: "r1"})[0] == 200
    assert answer(url, {REPLICA_HEADER: "r1"})[0] == 401


def test_a_grpc_call_meant_for_another_replica_is_unavailable(named: ThreadedServer) -> None:
    with grpc.insecure_channel(named.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelMetadataRequest(name="add")
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelMetadata(request, metadata=((HEADER, SECRET), (REPLICA_HEADER, "r0")))
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "'r1'" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelMetadata(request, metadata=((REPLICA_HEADER, "r1"),))
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert stub.ModelMetadata(request, metadata=((HEADER, SECRET), (REPLICA_HEADER, "r1"))).name == "add"
        assert stub.ModelMetadata(request, metadata=((HEADER, SECRET),)).name == "add"


def test_the_replica_id_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPLICA_ID_ENV, "lin-1a2b3c")
    assert ServerSettings(repository=tmp_path).replica_id == "lin-1a2b3c"
    monkeypatch.delenv(REPLICA_ID_ENV)
    assert ServerSettings(repository=tmp_path).replica_id == ""
