"""The gRPC front end driven by Triton's own gRPC client: every endpoint, and bad requests with the right
status codes while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.protocols.conftest import MAX_BODY, ThreadedServer


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(server.grpc)
    yield c
    c.close()


def add_inputs(x: np.ndarray, y: np.ndarray, datatype: str = "FP32") -> list[grpcclient.InferInput]:
    inputs = []
    for name, a in (("INPUT0", x), ("INPUT1", y)):
        i = grpcclient.InferInput(name, list(a.shape), datatype)
        i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def still_serving(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(client.infer("add", add_inputs(x, x)).as_numpy("OUTPUT0"), x * 2)


def test_health_metadata_config(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.get_server_metadata().name == "octacloud"
    meta = client.get_model_metadata("add")
    assert list(meta.versions) == ["1", "2"]
    first = meta.inputs[0]
    assert (first.name, first.datatype, list(first.shape)) == ("INPUT0", "FP32", [-1, 4])
    assert client.get_model_metadata("add", "1").name == "add"
    assert client.is_model_ready("add")
    assert client.is_model_ready("add", "2")
    assert not client.is_model_ready("add", "5")
    assert not client.is_model_ready("nope")
    config = client.get_model_config("add").config
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 1000


def test_infer_with_versions_and_requested_outputs(client: grpcclient.InferenceServerClient) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    r = client.infer("add", add_inputs(x, x), outputs=[grpcclient.InferRequestedOutput("OUTPUT0")], request_id="7")
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x * 2)
    assert r.get_response().id == "7"
    assert r.get_response().model_version == "2"
    assert client.infer("add", add_inputs(x, x), model_version="1").get_response().model_version == "1"


def test_infer_bytes(client: grpcclient.InferenceServerClient) -> None:
    data = np.array([[b"a", b"\xff\x00"], [b"", b"long" * 100]], dtype=object)
    i = grpcclient.InferInput("INPUT0", [2, 2], "BYTES")
    i.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("echo_bytes", [i]).as_numpy("OUTPUT0"), data)


def test_typed_contents_instead_of_raw(server: ThreadedServer) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="add")
        for name in ("INPUT0", "INPUT1"):
            t = request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            t.contents.fp32_contents.extend([1, 2, 3, 4])
        response = stub.ModelInfer(request)
        out = np.frombuffer(response.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(out, [2, 4, 6, 8])


def test_streaming(client: grpcclient.InferenceServerClient) -> None:
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    x = np.ones((1, 4), np.float32)
    client.async_stream_infer("add", add_inputs(x, x), request_id="s1")
    client.async_stream_infer("nope", add_inputs(x, x), request_id="s2")
    client.stop_stream()
    assert len(results) == 2
    ok = [r for r in results if not isinstance(r, InferenceServerException)]
    assert len(ok) == 1
    np.testing.assert_array_equal(ok[0].as_numpy("OUTPUT0"), x * 2)  # type: ignore[attr-defined]


def test_statistics_and_repository(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((3, 4), np.float32)
    client.infer("add", add_inputs(x, x), model_version="1")
    stats = client.get_inference_statistics("add", "1").model_stats
    assert stats[0].inference_count >= 3
    assert stats[0].inference_stats.compute_infer.count >= 1
    assert stats[0].batch_stats
    assert len(client.get_inference_statistics().model_stats) >= 4
    index = {(m.name, m.version): m for m in client.get_model_repository_index().models}
    assert index[("add", "2")].state == "READY"
    assert "onnxruntime cannot load it" in index[("broken", "")].reason
    with pytest.raises(InferenceServerException, match="not allowed") as e:
        client.unload_model("add")
    assert e.value.status() == "StatusCode.FAILED_PRECONDITION"


@pytest.mark.parametrize(
    ("model", "version", "make", "code", "message"),
    [
        (
            "add",
            "",
            lambda x: add_inputs(x.astype(np.float64), x.astype(np.float64), "FP64"),
            "INVALID_ARGUMENT",
            "datatype FP64 does not match the model's FP32",
        ),
        ("add", "", lambda x: add_inputs(x[:, :2], x[:, :2]), "INVALID_ARGUMENT", r"shape \[2, 2\]"),
        ("add", "", lambda x: add_inputs(x, x)[1:], "INVALID_ARGUMENT", "needs input\\(s\\) 'INPUT0'"),
        ("nope", "", lambda x: add_inputs(x, x), "NOT_FOUND", "unknown model 'nope'"),
        ("add", "3", lambda x: add_inputs(x, x), "NOT_FOUND", "no version '3'"),
        ("broken", "", lambda x: add_inputs(x, x), "UNAVAILABLE", "not available"),
        ("failing", "", lambda x: add_inputs(x, x)[:1], "INTERNAL", "failed on purpose"),
    ],
)
def test_errors_have_the_right_code_and_name_the_problem(
    client: grpcclient.InferenceServerClient, model: str, version: str, make: object, code: str, message: str
) -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(InferenceServerException, match=message) as e:
        client.infer(model, make(x), model_version=version)  # type: ignore[operator]
    assert e.value.status() == f"StatusCode.{code}"
    still_serving(client)


def test_truncated_raw_input_and_oversized_message(
    server: ThreadedServer, client: grpcclient.InferenceServerClient
) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="add")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(b"\0" * 10)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'INPUT0': 10 bytes of data" in e.value.details()
    x = np.ones((MAX_BODY // 16 + 1, 4), np.float32)
    with pytest.raises(InferenceServerException) as big:
        client.infer("add", add_inputs(x, x))
    assert big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    still_serving(client)


def test_requests_of_one_stream_run_concurrently(
    server: ThreadedServer, client: grpcclient.InferenceServerClient
) -> None:
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    x = np.ones((1, 4), np.float32)
    server.fakes.overlap.reset()
    for n in range(4):
        i = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        i.set_data_from_numpy(x * n)
        client.async_stream_infer("slow", [i], request_id=str(n))
    client.stop_stream()  # waits for every response
    assert sorted(r.get_response().id for r in results) == ["0", "1", "2", "3"]  # type: ignore[attr-defined]
    assert server.fakes.overlap.peak >= 2  # one after the other would never have two of them under way at once
