"""The REST front end driven by Triton's own HTTP client (JSON and binary tensors, every endpoint), and bad
requests that each get a clear error while the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.protocols.conftest import MAX_BODY, ThreadedServer


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.http)
    yield c
    c.close()


def add_inputs(x: np.ndarray, y: np.ndarray, binary: bool) -> list[httpclient.InferInput]:
    inputs = []
    for name, a in (("INPUT0", x), ("INPUT1", y)):
        i = httpclient.InferInput(name, list(a.shape), "FP64" if a.dtype == np.float64 else "FP32")
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    return inputs


def raw(
    server: ThreadedServer, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(f"http://{server.http}{path}", data=body or None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def still_serving(client: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    r = client.infer("add", add_inputs(x, x, True))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x * 2)


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "octacloud"
    assert {"binary_tensor_data", "statistics", "model_configuration", "model_repository"} <= set(meta["extensions"])


def test_model_metadata_ready_and_config_with_and_without_version(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("add")
    assert meta["versions"] == ["1", "2"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    assert client.get_model_metadata("add", "1")["name"] == "add"
    assert client.is_model_ready("add")
    assert client.is_model_ready("add", "1")
    assert not client.is_model_ready("add", "7")
    assert not client.is_model_ready("broken")
    config = client.get_model_config("add", "2")
    assert config["max_batch_size"] == 8  # numbers, not strings, as Triton prints them
    assert config["input"][0]["dims"] == [4]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000


@pytest.mark.parametrize("binary", [False, True])
def test_infer_json_and_binary(client: httpclient.InferenceServerClient, binary: bool) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    r = client.infer("add", add_inputs(x, x, binary), outputs=out, request_id="abc")
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x * 2)
    response = r.get_response()
    assert response["id"] == "abc"
    assert response["model_version"] == "2"
    r1 = client.infer("add", add_inputs(x, x, binary), model_version="1")
    assert r1.get_response()["model_version"] == "1"


def test_infer_bytes_tensors(client: httpclient.InferenceServerClient) -> None:
    data = np.array([[b"hello", b"w\xc3\xb6rld"], [b"", b"x"]], dtype=object)
    for binary in (False, True):
        i = httpclient.InferInput("INPUT0", [2, 2], "BYTES")
        i.set_data_from_numpy(data, binary_data=binary)
        r = client.infer("echo_bytes", [i], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
        out = r.as_numpy("OUTPUT0")
        if not binary:  # JSON carries strings: the client gives str back, as with Triton
            out = np.vectorize(str.encode, otypes=[object])(out)
        np.testing.assert_array_equal(out, data)


def test_a_batch_larger_than_max_batch_size_is_split_not_refused(client: httpclient.InferenceServerClient) -> None:
    x = np.random.default_rng(0).random((20, 4), dtype=np.float32)
    r = client.infer("add", add_inputs(x, x, True))
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), x * 2)


def test_statistics(client: httpclient.InferenceServerClient) -> None:
    x = np.ones((2, 4), np.float32)
    client.infer("add", add_inputs(x, x, True), model_version="1")
    stats = client.get_inference_statistics("add", "1")["model_stats"]
    assert len(stats) == 1
    s = stats[0]
    assert s["name"] == "add"
    assert s["inference_count"] >= 2
    assert s["execution_count"] >= 1
    assert s["inference_stats"]["success"]["count"] >= 1
    assert s["batch_stats"][0]["compute_infer"]["ns"] > 0
    names = {(m["name"], m["version"]) for m in client.get_inference_statistics()["model_stats"]}
    assert ("add", "2") in names
    assert len(client.get_inference_statistics("add")["model_stats"]) == 2


def test_repository_index_and_mode_none_refuses_load(client: httpclient.InferenceServerClient) -> None:
    index = {(m["name"], m.get("version", "")): m for m in client.get_model_repository_index()}
    assert index[("add", "1")]["state"] == "READY"
    assert index[("broken", "")]["state"] == "UNAVAILABLE"
    assert "onnxruntime cannot load it" in index[("broken", "")]["reason"]
    with pytest.raises(InferenceServerException, match="not allowed in model control mode 'none'"):
        client.load_model("add")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda x: add_inputs(x.astype(np.float64), x, True), "datatype FP64 does not match the model's FP32"),
        (lambda x: add_inputs(x[:, :3], x, False), r"shape \[2, 3\] does not match the model's \[-1, 4\]"),
        (lambda x: add_inputs(x, x, True)[:1], "needs input\\(s\\) 'INPUT1'"),
        (lambda x: [*add_inputs(x, x, True)[:1], _named("INPUT9", x)], "has no input 'INPUT9'"),
    ],
)
def test_bad_inputs_get_a_clear_400(client: httpclient.InferenceServerClient, make: object, message: str) -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(InferenceServerException, match=message) as e:
        client.infer("add", make(x))  # type: ignore[operator]
    assert e.value.status() == "400"
    still_serving(client)


def _named(name: str, x: np.ndarray) -> httpclient.InferInput:
    i = httpclient.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def test_unknown_model_and_version_are_404(client: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
        client.infer("nope", add_inputs(x, x, True))
    assert e.value.status() == "404"
    with pytest.raises(InferenceServerException, match="no version '9'") as e:
        client.infer("add", add_inputs(x, x, True), model_version="9")
    assert e.value.status() == "404"
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
    with pytest.raises(InferenceServerException, match="not available"):
        client.infer("broken", add_inputs(x, x, True))
    still_serving(client)


def test_a_failing_model_is_500_and_only_its_request_fails(client: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    i = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    i.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="failed on purpose") as e:
        client.infer("failing", [i])
    assert e.value.status() == "500"
    still_serving(client)


def test_truncated_binary_and_bad_headers(server: ThreadedServer, client: httpclient.InferenceServerClient) -> None:
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
            ]
        }
    ).encode()
    body = header + b"\0" * 20  # 32 bytes announced, 20 sent
    status, out, _ = raw(
        server, "POST", "/v2/models/add/infer", body, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400
    assert "INPUT1" in json.loads(out)["error"]
    assert "truncated" in json.loads(out)["error"]
    status, out, _ = raw(server, "POST", "/v2/models/add/infer", body, {"Inference-Header-Content-Length": "999"})
    assert status == 400
    assert "Inference-Header-Content-Length is 999" in json.loads(out)["error"]
    status, out, _ = raw(server, "POST", "/v2/models/add/infer", b"{not json")
    assert status == 400
    assert "not valid JSON" in json.loads(out)["error"]
    bad_priority = {
        "parameters": {"priority": "high"},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
    }
    status, out, _ = raw(server, "POST", "/v2/models/add/infer", json.dumps(bad_priority).encode())
    assert status == 400
    assert "'priority' must be a non-negative integer" in json.loads(out)["error"]
    numbers_as_bytes = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], "data": [1, 2]}]}
    status, out, _ = raw(server, "POST", "/v2/models/echo_bytes/infer", json.dumps(numbers_as_bytes).encode())
    assert status == 400
    assert "BYTES data in JSON must be strings" in json.loads(out)["error"]
    status, out, _ = raw(server, "GET", "/v3/nothing")
    assert status == 404
    still_serving(client)


def test_oversized_body_is_413(server: ThreadedServer, client: httpclient.InferenceServerClient) -> None:
    x = np.ones((MAX_BODY // 16 + 1, 4), np.float32)
    with pytest.raises(InferenceServerException, match="over the limit") as e:
        client.infer("add", add_inputs(x, x, True))
    assert e.value.status() == "413"
    still_serving(client)


def test_explicit_mode_load_and_unload(explicit_server: ThreadedServer) -> None:
    c = httpclient.InferenceServerClient(explicit_server.http)
    try:
        assert c.is_model_ready("add")
        assert not c.is_model_ready("echo_bytes")
        c.load_model("echo_bytes")
        assert c.is_model_ready("echo_bytes")
        c.unload_model("echo_bytes")
        assert not c.is_model_ready("echo_bytes")
        with pytest.raises(InferenceServerException, match="onnxruntime cannot load it"):
            c.load_model("broken")
        with pytest.raises(InferenceServerException, match="unknown model"):
            c.load_model("nope")
        status, out, _ = raw(explicit_server, "POST", "/v2/repository/index", b'{"ready": true}')
        assert status == 200
        assert [(m["name"], m["version"]) for m in json.loads(out)] == [("add", "1"), ("add", "2")]
    finally:
        c.close()
