"""Raw text in (the replica tokenizes) and Triton's classification extension, over REST and gRPC."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from octacloud.serving.testing import add_onnx, write_onnx_model
from tests.protocols.conftest import ThreadedServer, start

VOCAB = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3, "octacloud": 4}
MAX_LENGTH = 8
TOKEN_NAMES = ("input_ids", "attention_mask")
LABELS = ["cat", "dog", "", "fish"]  # class 2 has an empty label line: "score:index" only

TOKENS_CONFIG = f"""
backend: "onnxruntime"
max_batch_size: 16
input [ {{ name: "input_ids" data_type: TYPE_INT64 dims: [-1] }},
        {{ name: "attention_mask" data_type: TYPE_INT64 dims: [-1] }} ]
output [ {{ name: "stats" data_type: TYPE_FP32 dims: [2] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
parameters {{ key: "octacloud.text.tokenizer" value {{ string_value: "tokenizer.json" }} }}
parameters {{ key: "octacloud.text.max_length" value {{ string_value: "{MAX_LENGTH}" }} }}
"""

CLASSES_CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] label_filename: "labels.txt" } ]
"""


def tokens_onnx() -> bytes:
    """``stats`` [N, 2] = (tokens the mask keeps, sum of their ids): shows exactly what the tokenizer fed."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["kept"]),
        helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [1])),
        helper.make_node("ReduceSum", ["attention_mask", "axes"], ["count"], keepdims=1),
        helper.make_node("ReduceSum", ["kept", "axes"], ["total"], keepdims=1),
        helper.make_node("Concat", ["count", "total"], ["both"], axis=1),
        helper.make_node("Cast", ["both"], ["stats"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "tokens",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
            for n in ("input_ids", "attention_mask")
        ],
        [helper.make_tensor_value_info("stats", TensorProto.FLOAT, ["batch", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    tokenizer.save(str(path))  # no padding or truncation in the file: the replica sets both


def expected(text: str) -> list[float]:
    ids = [VOCAB.get(w, VOCAB["[UNK]"]) for w in text.split()][:MAX_LENGTH]
    return [float(len(ids)), float(sum(ids))]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    root = tmp_path_factory.mktemp("models")
    folder = write_onnx_model(root, "tokens", tokens_onnx(), TOKENS_CONFIG)
    write_tokenizer(folder / "1" / "tokenizer.json")
    folder = write_onnx_model(root, "classes", add_onnx(), CLASSES_CONFIG)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    write_onnx_model(root, "unlabelled", add_onnx(), CLASSES_CONFIG.replace(' label_filename: "labels.txt"', ""))
    s = start(root)
    yield s
    s.stop()


@pytest.fixture
def rest(server: ThreadedServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.http, concurrency=8)
    yield c
    c.close()


@pytest.fixture
def grpc_client(server: ThreadedServer) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(server.grpc)
    yield c
    c.close()


def text_input(module: object, texts: list[bytes], shape: list[int] | None = None) -> list[object]:
    data = np.array(texts, dtype=object).reshape(shape or [len(texts), 1])
    i = module.InferInput("text", list(data.shape), "BYTES")  # type: ignore[attr-defined]
    i.set_data_from_numpy(data)
    return [i]


def post(server: ThreadedServer, model: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(
        f"http://{server.http}/v2/models/{model}/infer", json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- text ----------------------------------------------------------------------------------------------------
TEXTS = ["hello world", "octacloud octacloud whatever", "hello " * 12, "world"]


def test_raw_text_is_tokenized_in_the_replica_rest_and_grpc(
    rest: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    want = np.array([expected(t) for t in TEXTS], np.float32)  # the third is truncated to MAX_LENGTH tokens
    got = rest.infer("tokens", text_input(httpclient, [t.encode() for t in TEXTS])).as_numpy("stats")
    np.testing.assert_array_equal(got, want)
    got = grpc_client.infer("tokens", text_input(grpcclient, [t.encode() for t in TEXTS])).as_numpy("stats")
    np.testing.assert_array_equal(got, want)
    flat = rest.infer("tokens", text_input(httpclient, [b"hello"], shape=[1])).as_numpy("stats")
    np.testing.assert_array_equal(flat, [[1, 2]])


def test_texts_of_different_lengths_batch_together(rest: httpclient.InferenceServerClient) -> None:
    # every row is padded to the same length, so requests the dynamic batcher merges fit one batch
    texts = [" ".join(["hello"] * n) for n in range(1, 9)]
    # all eight in flight at once through the client's own pool (its greenlets): one client's infer() is not
    # safe to call from several threads (gevent: "Cannot switch to a different thread")
    pending = [rest.async_infer("tokens", text_input(httpclient, [t.encode()])) for t in texts]
    results = [p.get_result() for p in pending]
    for t, r in zip(texts, results, strict=True):
        np.testing.assert_array_equal(r.as_numpy("stats"), [expected(t)])


def test_token_inputs_still_work(rest: httpclient.InferenceServerClient) -> None:
    inputs = []
    for name, a in (("input_ids", np.array([[2, 3, 0]])), ("attention_mask", np.array([[1, 1, 0]]))):
        i = httpclient.InferInput(name, list(a.shape), "INT64")
        i.set_data_from_numpy(a.astype(np.int64))
        inputs.append(i)
    np.testing.assert_array_equal(rest.infer("tokens", inputs).as_numpy("stats"), [[2, 5]])


@pytest.mark.parametrize(
    ("inp", "message"),
    [
        ({"name": "text", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}, "datatype must be BYTES"),
        ({"name": "text", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}, "must be [batch] or [batch, 1]"),
    ],
)
def test_malformed_text_is_a_400_naming_the_problem(
    server: ThreadedServer, inp: dict[str, object], message: str
) -> None:
    status, body = post(server, "tokens", {"inputs": [inp]})
    assert status == 400 and message in str(body["error"]), body


def test_text_with_token_inputs_or_bad_utf8_is_refused(
    rest: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    ids = httpclient.InferInput("input_ids", [1, 1], "INT64")
    ids.set_data_from_numpy(np.array([[2]], np.int64))
    with pytest.raises(InferenceServerException, match="replaces the token inputs") as exc:
        rest.infer("tokens", [*text_input(httpclient, [b"hello"]), ids])
    assert exc.value.status() == "400"
    with pytest.raises(InferenceServerException, match="row 1 is not UTF-8") as exc:
        grpc_client.infer("tokens", text_input(grpcclient, [b"hello", b"\xff\xfe"]))
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"


# ---- classification ------------------------------------------------------------------------------------------
X = np.array([[0.5, 3.0, 2.0, -1.0], [4.0, 1.0, 1.0, 0.0]], np.float32)
ZERO = np.zeros_like(X)


def add_inputs(module: object) -> list[object]:
    inputs = []
    for name, a in (("INPUT0", X), ("INPUT1", ZERO)):
        i = module.InferInput(name, list(a.shape), "FP32")  # type: ignore[attr-defined]
        i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def as_bytes(value: object) -> bytes:
    """A BYTES element as the clients give it back: bytes (binary data, gRPC) or str (JSON)."""
    return value if isinstance(value, bytes) else str(value).encode()


WANT_TOP3 = [
    [b"3.000000:1:dog", b"2.000000:2", b"0.500000:0:cat"],
    [b"4.000000:0:cat", b"1.000000:1:dog", b"1.000000:2"],  # a tie keeps the lower index first
]


@pytest.mark.parametrize("binary", [False, True])
def test_class_count_over_rest(rest: httpclient.InferenceServerClient, binary: bool) -> None:
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=3)
    got = rest.infer("classes", add_inputs(httpclient), outputs=[out]).as_numpy("OUTPUT0")
    assert got.shape == (2, 3)
    assert [[as_bytes(v) for v in row] for row in got] == WANT_TOP3


def test_class_count_over_grpc_and_without_labels(grpc_client: grpcclient.InferenceServerClient) -> None:
    out = grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)
    got = grpc_client.infer("classes", add_inputs(grpcclient), outputs=[out]).as_numpy("OUTPUT0")
    assert [[as_bytes(v) for v in row] for row in got] == WANT_TOP3
    out = grpcclient.InferRequestedOutput("OUTPUT0", class_count=10)  # more than there are: all 4, ranked
    got = grpc_client.infer("unlabelled", add_inputs(grpcclient), outputs=[out]).as_numpy("OUTPUT0")
    assert [as_bytes(v) for v in got[0]] == [b"3.000000:1", b"2.000000:2", b"0.500000:0", b"-1.000000:3"]


def test_without_class_count_the_scores_come_back(rest: httpclient.InferenceServerClient) -> None:
    got = rest.infer("classes", add_inputs(httpclient)).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(got, X)


@pytest.mark.parametrize("value", ["three", 0, -2, 1.5, True, None])
def test_malformed_class_count_over_rest_is_a_400(server: ThreadedServer, value: object) -> None:
    body = {
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": [2, 4], "data": a.reshape(-1).tolist()}
            for n, a in (("INPUT0", X), ("INPUT1", ZERO))
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": value}}],
    }
    status, answer = post(server, "classes", body)
    assert status == 400, answer
    assert "'classification' (class_count)" in str(answer["error"]) and "OUTPUT0" in str(answer["error"])


@pytest.mark.parametrize("field", ["int64_param", "string_param", "bool_param"])
def test_malformed_class_count_over_grpc_is_invalid_argument(server: ThreadedServer, field: str) -> None:
    value = {"int64_param": -1, "string_param": "3", "bool_param": True}[field]
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="classes")
        for name, a in (("INPUT0", X), ("INPUT1", ZERO)):
            t = request.inputs.add(name=name, datatype="FP32", shape=list(a.shape))
            t.contents.fp32_contents.extend(a.reshape(-1).tolist())
        out = request.outputs.add(name="OUTPUT0")
        setattr(out.parameters["classification"], field, value)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'classification' (class_count)" in str(exc.value.details())


def test_the_server_advertises_classification(rest: httpclient.InferenceServerClient) -> None:
    assert "classification" in rest.get_server_metadata()["extensions"]
