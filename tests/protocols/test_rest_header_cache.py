"""The REST codec's header cache (``codec.HeaderCache``): a header seen before is not parsed again, but every call
still gets its own data, its own objects and the same errors as without the cache; answers' headers encoded once
are byte for byte what encoding them afresh gives. Then through the server, with Triton's client: many calls of
one header and different data, from two callers at once, each answered with its own sum; a call whose data does
not match its (cached) header refused as before, and the server serving on."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from octacloud.protocols.rest.codec import HeaderCache, decode_infer, encode_infer
from octacloud.serving import InferenceResponse, InvalidInputError, Tensor
from tests.protocols.conftest import ThreadedServer
from tests.protocols.test_rest import add_inputs, raw, still_serving


@pytest.fixture
def client(server: ThreadedServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.http)
    yield c
    c.close()


def binary_header(*inputs: tuple[str, str, list[int], int], **extra: object) -> bytes:
    entries = [
        {"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": size}} for n, d, s, size in inputs
    ]
    return json.dumps({"inputs": entries, **extra}).encode()


HEADER = binary_header(
    ("a", "FP32", [1, 4], 16),
    ("b", "INT64", [1, 2], 16),
    outputs=[{"name": "y", "parameters": {"binary_data": True}}],
    parameters={"priority": 2, "timeout": 5000, "binary_data_output": True},
    id="same",
)


def body(a: np.ndarray, b: np.ndarray, header: bytes = HEADER) -> bytes:
    return header + a.astype(np.float32).tobytes() + b.astype(np.int64).tobytes()


def test_a_cached_header_gives_what_parsing_gives_with_each_calls_own_data() -> None:
    cache = HeaderCache()
    rng = np.random.default_rng(0)
    for _ in range(5):
        a, b = rng.random((1, 4)), rng.integers(0, 100, (1, 2))
        data = body(a, b)
        cached = decode_infer(data, len(HEADER), "m", "3", cache)
        plain = decode_infer(data, len(HEADER), "m", "3")
        assert len(cache.requests) == 1  # parsed once, then looked up
        assert (cached.model, cached.version, cached.id) == ("m", "3", "same")
        assert (cached.priority, cached.timeout_us) == (plain.priority, plain.timeout_us) == (2, 5000)
        assert cached.parameters == plain.parameters and cached.outputs == plain.outputs
        for x, y in zip(cached.inputs, plain.inputs, strict=True):
            assert (x.name, x.datatype, x.shape, x.parameters) == (y.name, y.datatype, y.shape, y.parameters)
            np.testing.assert_array_equal(x.data, y.data)
        np.testing.assert_array_equal(cached.inputs[0].data, a.astype(np.float32))  # this call's data, not a kept one
        np.testing.assert_array_equal(cached.inputs[1].data, b)
        # what one call's code does to its request does not reach the next call's
        cached.parameters["priority"] = 9  # type: ignore[index]
        cached.inputs[0].parameters["binary_data_size"] = 0  # type: ignore[index]
        cached.outputs[0].parameters["binary_data"] = False  # type: ignore[index]
        assert cached.inputs[0].data is not plain.inputs[0].data


def test_the_model_and_version_of_the_path_are_part_of_the_key() -> None:
    cache = HeaderCache()
    data = body(np.ones((1, 4)), np.ones((1, 2)))
    seen = [decode_infer(data, len(HEADER), m, v, cache) for m, v in (("m", ""), ("n", ""), ("m", "2"), ("m", ""))]
    assert [(r.model, r.version) for r in seen] == [("m", ""), ("n", ""), ("m", "2"), ("m", "")]
    assert len(cache.requests) == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (HEADER + b"\0" * 20, "input 'b': binary data is truncated"),
        (HEADER + b"\0" * 40, "8 bytes of binary data follow the inputs"),
    ],
)
def test_a_cached_header_with_the_wrong_amount_of_data_is_refused_as_without_the_cache(
    data: bytes, message: str
) -> None:
    cache = HeaderCache()
    decode_infer(body(np.ones((1, 4)), np.ones((1, 2))), len(HEADER), "m", "", cache)
    errors = []
    for c in (cache, None):
        with pytest.raises(InvalidInputError) as e:
            decode_infer(data, len(HEADER), "m", "", c)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and message in errors[0]
    ok = decode_infer(body(np.zeros((1, 4)), np.zeros((1, 2))), len(HEADER), "m", "", cache)  # still served
    assert ok.inputs[0].data.shape == (1, 4)


def test_bytes_contents_are_checked_on_every_call() -> None:
    header = binary_header(("s", "BYTES", [2], 10))
    good = header + b"\1\0\0\0x" + b"\1\0\0\0y"
    cache = HeaderCache()
    assert list(decode_infer(good, len(header), "m", "", cache).inputs[0].data) == [b"x", b"y"]
    bad = header + b"\1\0\0\0x" + b"\6\0\0\0y"  # the same length, the second element's prefix past the end
    with pytest.raises(InvalidInputError, match="BYTES element 1 is truncated"):
        decode_infer(bad, len(header), "m", "", cache)


def test_headers_that_carry_data_or_are_too_long_are_not_kept_and_the_cache_is_bounded() -> None:
    cache = HeaderCache(max_entries=4)
    with_data = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.0]}]}).encode()
    decode_infer(with_data, len(with_data), "m", "", cache)
    assert decode_infer(with_data, None, "m", "", cache).inputs[0].data.tolist() == [1.0]
    assert cache.requests == {}
    long = binary_header(("a", "FP32", [1], 4), id="x" * 5000)
    decode_infer(long + b"\0" * 4, len(long), "m", "", cache)
    assert cache.requests == {}
    for i in range(10):  # a fresh id per call: each header differs
        h = binary_header(("a", "FP32", [1], 4), id=str(i))
        assert decode_infer(h + b"\0" * 4, len(h), "m", "", cache).id == str(i)
        assert len(cache.requests) <= 4


def response(model: str, id_: str, *outputs: Tensor) -> InferenceResponse:
    return InferenceResponse(model, "1", list(outputs), id_)


def test_answers_headers_are_encoded_once_and_the_same_as_encoded_afresh() -> None:
    cache = HeaderCache()
    data = body(np.ones((1, 4)), np.ones((1, 2)))
    request = decode_infer(data, len(HEADER), "m", "", cache)
    rng = np.random.default_rng(1)
    answers = [
        response("m", "same", Tensor("y", "FP32", (1, 3), rng.random((1, 3), dtype=np.float32))),
        response("m", "same", Tensor("y", "FP32", (1, 3), rng.random((1, 3), dtype=np.float32))),
        response("m", "other", Tensor("y", "FP32", (1, 3), rng.random((1, 3), dtype=np.float32))),
        response("m", "same", Tensor("y", "FP32", (2, 3), rng.random((2, 3), dtype=np.float32))),
        response("n", "same", Tensor("y", "BYTES", (2,), np.array([b"ab", b"c"], dtype=object))),
        response("n", "same", Tensor("y", "BYTES", (2,), np.array([b"abc", b"d"], dtype=object))),
    ]
    for a in answers:
        assert encode_infer(a, request, cache) == encode_infer(a, request)
    assert len(cache.responses) == 5  # the second answer reused the first one's header
    # an output asked for as JSON carries its data in the header: not kept
    plain = decode_infer(json.dumps({"inputs": [], "outputs": [{"name": "y"}]}).encode(), None, "m", "", cache)
    before = dict(cache.responses)
    assert encode_infer(answers[0], plain, cache) == encode_infer(answers[0], plain)
    assert cache.responses == before


def test_one_header_many_calls_two_callers_each_get_their_own_answer(
    server: ThreadedServer, client: httpclient.InferenceServerClient
) -> None:
    """The same header again and again with different data, from two callers at once (two connections, as two
    tenants' calls reach a replica): every answer is the sum of that call's own inputs."""
    failures: list[str] = []

    def caller(seed: int) -> None:
        c = httpclient.InferenceServerClient(server.http)
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                x, y = rng.random((2, 4), dtype=np.float32), rng.random((2, 4), dtype=np.float32)
                out = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
                got = c.infer("add", add_inputs(x, y, True), outputs=out).as_numpy("OUTPUT0")
                if not np.array_equal(got, x + y):
                    failures.append(f"caller {seed}: {got} != {x + y}")
        finally:
            c.close()

    threads = [threading.Thread(target=caller, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    # the header those calls used, now followed by too little data: refused as ever, and the server serves on
    header = binary_header(("INPUT0", "FP32", [2, 4], 32), ("INPUT1", "FP32", [2, 4], 32))
    status, out, _ = raw(
        server,
        "POST",
        "/v2/models/add/infer",
        header + b"\0" * 40,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400 and "truncated" in json.loads(out)["error"]
    still_serving(client)
