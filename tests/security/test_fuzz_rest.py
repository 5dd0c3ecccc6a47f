"""A standing REST fuzzer against the gateway of a real cloud: thousands of seeded, generated requests
(mutated OIP inference bodies, odd paths, methods, keys, framing); every answer must be a clean 4xx or a
correct 2xx, none may hang, and the cloud must keep serving. A 5xx is sent again straight to the replica
(with the internal secret): when the replica answers the same, it is counted as the replica's, not the
gateway's. The counts are printed (``pytest -s``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from octacloud.security.internal_auth import FILE_NAME, HEADER
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until

from .conftest import call, make_tenant

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("OCTACLOUD_FUZZ_CASES", "2000"))
BUDGET_S = float(os.environ.get("OCTACLOUD_FUZZ_SECONDS", "120"))
HANG_S = 10.0


@dataclass
class Target:
    cloud: CloudThread
    key_a: str
    key_b: str
    gateway_port: int
    replica_port: int
    secret: str


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("fuzz-rest")
    write_linear_model(root / "models")
    c = CloudThread(config(root, root / "models"))
    try:
        key_a, key_b = make_tenant(c, "a"), make_tenant(c, "b")
        assert call(c, key_a, "POST", "/admin/deployments", {"name": "a-lin", "model": "linear"}).status_code == 201
        wait_until("a-lin ready", lambda: bool(ready_ids(c, "a-lin")))
        [instance] = [i for i in c.deployment("a-lin")["instances"] if i["state"] == "ready"]
        secret = (root / "var" / FILE_NAME).read_text().strip()
        yield Target(c, key_a, key_b, c.cloud.http_port, instance["http_port"], secret)
    finally:
        c.stop(stop_replicas=True)


# ---- generation ---------------------------------------------------------------------------------------

WEIRD = [None, True, 0, -1, 1.5, 2**70, "", "x" * 300, [], {}, [[]], {"a": 1}, "FP32", float("nan")]


def valid_body(rng: random.Random, rows: int = 2) -> dict[str, Any]:
    data = [round(rng.uniform(-3, 3), 3) for _ in range(rows * IN)]
    return {"inputs": [{"name": "INPUT0", "shape": [rows, IN], "datatype": "FP32", "data": data}]}


def mutate(rng: random.Random, body: dict[str, Any]) -> Any:
    tensor = body["inputs"][0]
    choice = rng.randrange(16)
    if choice == 0:
        tensor[rng.choice(list(tensor))] = rng.choice(WEIRD)
    elif choice == 1:
        del tensor[rng.choice(list(tensor))]
    elif choice == 2:
        tensor["shape"] = rng.choice([[1.5, IN], [True, IN], "12", [-1, IN], [2**40, IN], [], [2, IN, 1], [0, IN]])
    elif choice == 3:
        tensor["datatype"] = rng.choice(["INT8", "BYTES", "FP64", "BOOL", "fp32", "FP3", "", "UINT64", "FP16"])
    elif choice == 4:
        tensor["data"] = tensor["data"][: rng.randrange(len(tensor["data"]))]
    elif choice == 5:
        tensor["data"] = [rng.choice(WEIRD) for _ in range(2 * IN)]
    elif choice == 6:
        body["parameters"] = rng.choice(WEIRD)
    elif choice == 7:
        body["outputs"] = rng.choice(
            [5, "x", [{"name": "NOPE"}], [{}], [{"name": 3}], [{"name": "OUTPUT0", "parameters": 1}]]
        )
    elif choice == 8:
        body["inputs"] = rng.choice(WEIRD)
    elif choice == 9:
        body["inputs"].append(dict(tensor))  # the same input twice
    elif choice == 10:
        tensor["data"] = f"__NESTED_{rng.choice([50, 1000, 5000])}__"  # spelled out by encode_json
    elif choice == 11:
        body["id"] = rng.choice(WEIRD)
    elif choice == 12:
        return rng.choice(WEIRD)  # not an object at all
    elif choice == 13:
        tensor["name"] = rng.choice(["INPUT1", "", "../x", "\u00e9", "INPUT0\x00"])
    elif choice == 14:
        tensor["data"] = [[rng.random() for _ in range(IN)] for _ in range(2)]  # nested rows: allowed by OIP
    return body


def encode_json(rng: random.Random, value: Any) -> bytes:
    text = json.dumps(value, allow_nan=True)
    if "__NESTED_" in text:
        depth = int(text.split("__NESTED_", 1)[1].split("__", 1)[0])
        text = text.replace(f'"__NESTED_{depth}__"', "[" * depth + "0" + "]" * depth)
    r = rng.random()
    if r < 0.04:
        text = text.replace("0.", "1e400*0.", 1).replace("*", "", 1)  # 10^400: a float JSON cannot hold
    elif r < 0.08:
        text = text.replace("NaN", "Infinity")
    elif r < 0.12:
        text = text[: rng.randrange(max(1, len(text)))]  # truncated
    return text.encode()


PATHS = [
    "/v2/models/a-lin/infer",
    "/v2/models/a-lin/versions/1/infer",
    "/v2/models/a-lin/versions/9/infer",
    "/v2/models/a-lin/versions/x/infer",
    "/v2/models/a-lin",
    "/v2/models/a-lin/ready",
    "/v2/models/a-lin/config",
    "/v2/models/a-lin/stats",
    "/v2/models/a-lin/nope",
    "/v2/models//infer",
    "/v2/models/a-lin/../b-lin/infer",
    "/v2/models/%2e%2e/infer",
    "/v2/models/a-lin%00/infer",
    "/v2/models/" + "a" * 3000 + "/infer",
    "/v2/models/a-lin/infer?x=%ff%fe",
    "/v2",
    "/v2/repository/index",
    "/v2/repository/models/a-lin/unload",
    "/admin/deployments",
    "/admin/deployments/a-lin",
    "/nope",
]


@dataclass
class Case:
    wire: bytes
    expect_continue: bool
    body: bytes
    label: str


def generate(rng: random.Random, t: Target) -> Case:
    key = rng.choices([t.key_a, t.key_b, None, "garbage", "oc_ffffffffffff_" + "x" * 43], [80, 8, 4, 4, 4])[0]
    path = "/v2/models/a-lin/infer" if rng.random() < 0.6 else rng.choice(PATHS)
    method = "POST" if path.endswith(("infer", "load", "unload", "index")) else "GET"
    if rng.random() < 0.08:
        method = rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "GET", "POST", "TRACE"])
    r = rng.random()
    if r < 0.75:
        body = encode_json(rng, mutate(rng, valid_body(rng)) if rng.random() < 0.85 else valid_body(rng))
    elif r < 0.85:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    elif r < 0.92:  # Triton's binary tensor extension, with a header length that may lie
        head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 4 * IN}}]}).encode()  # fmt: skip
        body = head + np.ones(IN, np.float32).tobytes()[: rng.choice([4 * IN, 8, 0])]
        lengths = [len(head), len(head) + 3, 0, len(body) + 10, -1]
        body_header = f"Inference-Header-Content-Length: {rng.choice(lengths)}\r\n"
        return _frame(rng, method, path, key, body, body_header, "binary")
    else:
        body = b""
    return _frame(rng, method, path, key, body, "", "json")


def _frame(rng: random.Random, method: str, path: str, key: str | None, body: bytes, extra: str, label: str) -> Case:
    headers = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\n"
    if key is not None:
        headers += f"Authorization: Bearer {key}\r\n"
    headers += extra
    if rng.random() < 0.05:
        headers += f"{HEADER}: forged\r\n"
    framing = rng.random()
    if framing < 0.1:  # chunked
        chunks = b""
        rest = body
        while rest:
            n = rng.randrange(1, 64)
            chunks += b"%x\r\n%s\r\n" % (len(rest[:n]), rest[:n])
            rest = rest[n:]
        return Case(
            (headers + "Transfer-Encoding: chunked\r\n\r\n").encode() + chunks + b"0\r\n\r\n", False, b"", label
        )
    if framing < 0.16:  # announce, wait for 100 Continue
        head = f"{headers}Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        return Case(head, True, body, label + "+100")
    if method in ("GET", "HEAD") and not body:
        return Case((headers + "\r\n").encode(), False, b"", label)
    return Case((headers + f"Content-Length: {len(body)}\r\n\r\n").encode() + body, False, b"", label)


# ---- sending ------------------------------------------------------------------------------------------


async def send(port: int, case: Case, head_request: bool) -> tuple[int | None, bytes]:
    """(status, body) of the final answer; status None when the connection closed without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(case.wire)
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status == 100:
                writer.write(case.body)
                continue
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = b"" if head_request else await reader.readexactly(length)
            return status, body
    except (asyncio.IncompleteReadError, ConnectionError):
        return None, b""
    finally:
        writer.close()


def with_secret(case: Case, secret: str) -> Case:
    head, sep, rest = case.wire.partition(b"\r\n")
    lines = [line for line in rest.split(b"\r\n") if not line.lower().startswith(HEADER.encode())]
    return Case(
        head + sep + f"{HEADER}: {secret}\r\n".encode() + b"\r\n".join(lines),
        case.expect_continue,
        case.body,
        case.label,
    )


async def fuzz(t: Target) -> Counter[str]:
    rng = random.Random(20261201)
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + BUDGET_S
    for i in range(CASES):
        if time.monotonic() > deadline:
            break
        case = generate(rng, t)
        head_request = case.wire.startswith(b"HEAD ")
        counts["tried"] += 1
        try:
            status, body = await asyncio.wait_for(send(t.gateway_port, case, head_request), HANG_S)
        except TimeoutError:
            counts["hangs"] += 1
            print(f"HANG case {i}: {case.wire[:200]!r}")
            continue
        if status is None:
            counts["closed without answer"] += 1
            print(f"CLOSED case {i}: {case.wire[:200]!r}")
        elif 200 <= status < 300:
            counts["2xx"] += 1
            if case.wire.startswith(b"POST /v2/models/a-lin/infer") and status == 200 and case.label == "json":
                check_infer(case, body)
        elif 400 <= status < 500:
            counts["clean 4xx"] += 1
            assert b"Traceback" not in body, body[:400]
            if not head_request and not _json_error(body):
                counts["4xx not JSON"] += 1  # e.g. Starlette's plain "Method Not Allowed" from the admin API
        else:
            direct, _ = await asyncio.wait_for(send(t.replica_port, with_secret(case, t.secret), head_request), HANG_S)
            who = "replica" if direct == status else "gateway"
            counts[f"5xx ({who})"] += 1
            print(f"5xx ({who}) case {i}: {status} {body[:160]!r} <- {case.wire[:160]!r}")
    return counts


def _json_error(body: bytes) -> bool:
    try:
        return "error" in json.loads(body)
    except (ValueError, TypeError):
        return False


def check_infer(case: Case, body: bytes) -> None:
    """A 2xx inference answer is the model's result for the inputs sent (when they were valid floats)."""
    try:
        sent = json.loads(case.wire.partition(b"\r\n\r\n")[2] or case.body)
    except (ValueError, RecursionError):
        return  # chunked framing, or nesting Python's json cannot read back
    if not isinstance(sent, dict) or not isinstance(sent.get("inputs"), list) or not sent["inputs"]:
        return
    tensor = sent["inputs"][0]
    if not isinstance(tensor, dict) or not isinstance(tensor.get("data"), list):
        return
    if tensor.get("shape") != [2, IN] or not all(isinstance(v, float | int) for v in tensor.get("data", [None])):
        return
    got = json.loads(body)["outputs"][0]
    x = np.asarray(tensor["data"], np.float32).reshape(2, IN)
    np.testing.assert_allclose(np.asarray(got["data"], np.float32).reshape(2, -1), expected_output(x), rtol=1e-4)


@pytest.fixture(scope="module")
def counts(target: Target) -> Counter[str]:
    return asyncio.run(fuzz(target))


def test_rest_fuzz(target: Target, counts: Counter[str]) -> None:
    print("REST fuzz:", dict(counts))
    # the cloud keeps serving: a valid request after all of it
    body = valid_body(random.Random(1))
    answer = call(target.cloud, target.key_a, "POST", "/v2/models/a-lin/infer", body)
    assert answer.status_code == 200, answer.text
    assert counts["tried"] >= min(CASES, 500)
    assert counts["hangs"] == 0
    assert counts["closed without answer"] == 0
    assert counts["5xx (gateway)"] == 0, dict(counts)


def test_rest_fuzz_replica_answers_are_clean(counts: Counter[str]) -> None:
    """What the replica itself answers to the same malformed bodies (the OIP adapter's job, not the gateway's)."""
    assert counts["5xx (replica)"] == 0, f"the replica answered malformed requests with 5xx: {dict(counts)}"
