"""A seeded fuzzer against one replica (in-process :class:`ReplicaServer`) over REST and gRPC.

Thousands of malformed requests, generated from a valid one by mutation, bounded in time: every answer must be
a clean 4xx (gRPC: a client-error code) or a correct 2xx, no request may hang, nothing may be logged as an
internal error, and the replica keeps serving. The counts are printed (``pytest -s``).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.serving.testing import add_onnx, write_onnx_model
from tests.protocols.conftest import ADD_CONFIG, build_repository, start
from tests.serve_process import serve_process

SEED = int(os.environ.get("OCTACLOUD_FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("OCTACLOUD_FUZZ_CASES", "2000"))
BUDGET_S = float(os.environ.get("OCTACLOUD_FUZZ_SECONDS", "60"))
DEEP = "\u0000deep\u0000"
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}


@dataclass(frozen=True)
class Target:
    name: str
    http: str
    grpc: str
    process_log: Path | None = None
    """``octacloud serve``'s log (None in-process: caplog sees the records)."""

    def internal_errors(self, caplog: pytest.LogCaptureFixture) -> list[str]:
        if self.process_log is None:
            return [r.getMessage() for r in caplog.records if r.name.startswith("octacloud")]
        lines = self.process_log.read_text().splitlines()
        return [line for line in lines if "internal error" in line or "Traceback" in line or "Exception" in line]


@pytest.fixture(scope="module", params=["in-process", "octacloud serve"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("models")
    if request.param == "in-process":
        s = start(build_repository(root))
        yield Target(request.param, s.http, s.grpc)
        s.stop()
        return
    write_onnx_model(root, "add", add_onnx(), ADD_CONFIG, versions=(1, 2))  # a real process serves real models
    (root / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy: { all: {} }\n")
    with serve_process(root) as p:
        yield Target(request.param, f"127.0.0.1:{p.http}", f"127.0.0.1:{p.grpc}", p.log)


def _base() -> dict[str, Any]:
    return {
        "id": "case",
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]},
        ],
        "outputs": [{"name": "OUTPUT0"}],
        "parameters": {},
    }


def _value(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1.5,
            10**400,
            float("inf"),
            float("-inf"),
            float("nan"),
            "",
            "12",
            "FP32",
            "INPUT0",
            "\u00e9\u0000",
            [],
            {},
            [1.5, 4],
            [True, 4],
            [1, 4],
            [-1, 4],
            [2**63, 4],
            [[1, 2], [3]],
            {"binary_data_size": rng.choice([-1, 0, 16, 10**20, "16", True])},
            {"priority": rng.choice([-1, 1, "1", 1.5, True])},
            {"timeout": rng.choice([-5, 10**30, "x"])},
            {"binary_data_output": rng.choice([True, 5, "x"])},
            DEEP,
            [DEEP],
            5,
        ]
    )


def _mutate(doc: Any, rng: random.Random) -> Any:
    """Set, delete or replace a random field somewhere in ``doc``."""
    containers: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict | list):
            containers.append(x)
            for v in x.values() if isinstance(x, dict) else x:
                walk(v)

    walk(doc)
    if not containers or rng.random() < 0.05:
        return _value(rng)
    target = rng.choice(containers)
    if isinstance(target, dict):
        keys = [*target, "name", "datatype", "shape", "data", "parameters", "outputs", "inputs", "id"]
        key = rng.choice(keys)
        if rng.random() < 0.2:
            target.pop(key, None)
        else:
            target[key] = _value(rng)
    elif target and rng.random() < 0.5:
        target[rng.randrange(len(target))] = _value(rng)
    else:
        target.append(_value(rng))
    return doc


def rest_case(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    path = rng.choice(
        ["/v2/models/add/infer"] * 6
        + ["/v2/models/add/versions/2/infer", "/v2/models/add/versions/x/infer", "/v2/models/nope/infer"]
        + ["/v2/repository/index", "/v2/models/nope/versions/1/infer"]
    )
    doc: Any = _base()
    for _ in range(rng.randint(1, 3)):
        doc = _mutate(doc, rng)
    text = json.dumps(doc).replace(json.dumps(DEEP), "[" * 1000 + "]" * 1000)
    body = text.encode()
    headers = {"Content-Type": "application/json"}
    kind = rng.random()
    if kind < 0.05:
        body = body[: rng.randrange(len(body) + 1)]
    elif kind < 0.08:
        body = rng.randbytes(rng.randrange(64))
    elif kind < 0.15:
        body += rng.randbytes(rng.choice([0, 4, 16, 32]))
        headers["Inference-Header-Content-Length"] = rng.choice([str(len(text)), "-1", "x", str(len(body) + 5)])
    return path, body, headers


def _check_rest_ok(body: bytes, headers: dict[str, str]) -> None:
    if "inference-header-content-length" in {k.lower() for k in headers}:
        return
    answer = json.loads(body)
    assert isinstance(answer, dict | list), body[:200]


@pytest.mark.timeout(300)
def test_rest_fuzz_answers_only_clean_4xx_or_2xx(server: Target, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(SEED)
    host, port = server.http.rsplit(":", 1)
    counts: Counter[str] = Counter()
    bad: list[str] = []
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    deadline = time.monotonic() + BUDGET_S
    for i in range(CASES):
        if time.monotonic() > deadline:
            break
        path, body, headers = rest_case(rng)
        counts["tried"] += 1
        try:
            conn.request("POST", path, body, headers)
            r = conn.getresponse()
            answer = r.read()
        except TimeoutError:
            counts["hangs"] += 1
            bad.append(f"case {i}: hang on {path} {body[:200]!r}")
            conn.close()
            continue
        except (ConnectionError, http.client.HTTPException) as e:
            counts["resets"] += 1
            bad.append(f"case {i}: {type(e).__name__} on {path} {body[:200]!r}")
            conn.close()
            continue
        if 200 <= r.status < 300:
            counts["2xx"] += 1
            _check_rest_ok(answer, dict(r.getheaders()))
        elif 400 <= r.status < 500:
            counts["4xx"] += 1
            assert "error" in json.loads(answer), answer[:200]
        else:
            counts[f"{r.status // 100}xx"] += 1
            bad.append(f"case {i}: {r.status} {answer[:200]!r} for {path} {body[:300]!r}")
    conn.close()
    print(f"\nREST fuzz, {server.name} (seed {SEED}): {dict(counts)}")
    internal = server.internal_errors(caplog)
    assert not bad, "\n".join(bad[:10])
    assert not internal, internal[:5]
    assert counts["tried"] >= min(CASES, 500)
    assert counts["2xx"] > 0 and counts["4xx"] > 0


def _infer_request(rng: random.Random) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(
        model_name=rng.choice(["add"] * 8 + ["nope", "", "../add", "/etc"]),
        model_version=rng.choice(["", "", "", "1", "2", "3", "x"]),
        id=rng.choice(["", "id"]),
    )
    raw = rng.random() < 0.6
    for _ in range(rng.choice([0, 1, 2, 2, 2, 2, 3])):
        t = r.inputs.add(
            name=rng.choice(["INPUT0", "INPUT1", "INPUT0", "INPUT1", "X", ""]),
            datatype=rng.choice(["FP32"] * 6 + ["INT32", "BYTES", "FP64", "", "fp32", "XYZ", "BOOL", "UINT8"]),
            shape=rng.choice([[1, 4]] * 5 + [[], [4], [2, 4], [-1, 4], [0, 4], [2**62, 4], [1, 4, 1]]),
        )
        if raw:
            r.raw_input_contents.append(rng.choice([b"\0" * 16] * 4 + [b"", b"\0" * 15, rng.randbytes(32)]))
        else:
            field = rng.choice(["fp32_contents"] * 3 + ["int_contents", "bytes_contents", "bool_contents"])
            values: list[Any] = {
                "fp32_contents": [1.0, 2.0, 3.0, 4.0][: rng.randint(0, 4)],
                "int_contents": [1, 2, 3, 4],
                "bytes_contents": [b"a", b"b"],
                "bool_contents": [True, False, True, False],
            }[field]
            getattr(t.contents, field).extend(values)
        if rng.random() < 0.1:
            t.parameters["binary_data_size"].int64_param = rng.choice([-1, 16])
    if raw and rng.random() < 0.1:
        r.raw_input_contents.append(b"\0" * 16)
    for key in rng.sample(["priority", "timeout", "binary_data_output", "x"], rng.randint(0, 2)):
        p = r.parameters[key]
        which = rng.choice(["int64_param", "string_param", "bool_param", "double_param", "uint64_param"])
        value: Any = {
            "int64_param": rng.choice([-1, 0, 5, 2**62]),
            "string_param": "x",
            "bool_param": True,
            "double_param": 1.5,
            "uint64_param": 2**63,
        }[which]
        setattr(p, which, value)
    if rng.random() < 0.3:
        r.outputs.add(name=rng.choice(["OUTPUT0", "nope", ""]))
    return r


@pytest.mark.timeout(300)
def test_grpc_fuzz_answers_only_client_error_codes_or_ok(server: Target, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(SEED + 1)
    counts: Counter[str] = Counter()
    bad: list[str] = []
    methods = ["ModelInfer"] * 6 + ["ModelMetadata", "ModelConfig", "ModelStatistics", "ModelReady"]
    deadline = time.monotonic() + BUDGET_S
    with grpc.insecure_channel(server.grpc) as channel:
        for i in range(CASES):
            if time.monotonic() > deadline:
                break
            method = rng.choice(methods)
            data = _infer_request(rng).SerializeToString()
            kind = rng.random()
            if kind < 0.08:
                data = rng.randbytes(rng.randrange(1, 64))
            elif kind < 0.15 and data:
                data = data[: rng.randrange(len(data))]
            elif method != "ModelInfer":
                data = pb.ModelMetadataRequest(name=rng.choice(["add", "nope", ""]), version="").SerializeToString()
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            counts["tried"] += 1
            try:
                call(data, timeout=10)
                counts["ok"] += 1
            except grpc.RpcError as e:
                code = e.code()
                if code in CLIENT_ERRORS:
                    counts["client errors"] += 1
                elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    counts["hangs"] += 1
                    bad.append(f"case {i}: {method} hang")
                else:
                    counts[str(code)] += 1
                    bad.append(f"case {i}: {method} {code} {e.details()} for {data[:200]!r}")
    print(f"\ngRPC fuzz, {server.name} (seed {SEED + 1}): {dict(counts)}")
    internal = server.internal_errors(caplog)
    assert not bad, "\n".join(bad[:10])
    assert not internal, internal[:5]
    assert counts["ok"] > 0 and counts["client errors"] > 0


def test_the_fuzz_cases_are_reproducible(tmp_path: Path) -> None:
    a, b = random.Random(7), random.Random(7)
    assert [rest_case(a) for _ in range(50)] == [rest_case(b) for _ in range(50)]
