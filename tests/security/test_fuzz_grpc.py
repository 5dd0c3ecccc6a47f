"""A standing gRPC fuzzer against the gateway of a real cloud, and the gRPC bounds: thousands of seeded
generated calls (mutated ModelInferRequests, raw and truncated bytes, repeated fields, every method, good and
bad keys); every status must be OK or a clean client error, none may hang, and the cloud keeps serving. A
server-side status is re-sent straight to the replica (with the internal secret) to tell whose it is.
Also: the key is checked on metadata before the message is read, messages over the limit are refused by
gRPC itself, and the gateway routes on the model name protobuf reads (the last one)."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from octacloud.gateway.limits import MIB
from octacloud.security.internal_auth import FILE_NAME, HEADER
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until

from .conftest import call, make_tenant

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("OCTACLOUD_FUZZ_CASES", "2000"))
BUDGET_S = float(os.environ.get("OCTACLOUD_FUZZ_SECONDS", "120"))
SERVICE = "/inference.GRPCInferenceService/"
METHODS = ["ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics", "ServerMetadata"]
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass
class Target:
    cloud: CloudThread
    key_a: str
    key_b: str
    gateway: str
    replica: str
    secret: str


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("fuzz-grpc")
    write_linear_model(root / "models")
    c = CloudThread(config(root, root / "models"))
    try:
        key_a, key_b = make_tenant(c, "a"), make_tenant(c, "b")
        for key, name in ((key_a, "a-lin"), (key_b, "b-lin")):
            assert call(c, key, "POST", "/admin/deployments", {"name": name, "model": "linear"}).status_code == 201
        wait_until("deployments ready", lambda: bool(ready_ids(c, "a-lin") and ready_ids(c, "b-lin")))
        [instance] = [i for i in c.deployment("a-lin")["instances"] if i["state"] == "ready"]
        secret = (root / "var" / FILE_NAME).read_text().strip()
        yield Target(c, key_a, key_b, f"127.0.0.1:{c.cloud.grpc_port}", f"127.0.0.1:{instance['grpc_port']}", secret)
    finally:
        c.stop(stop_replicas=True)


def infer_request(rng: random.Random, name: str = "a-lin", rows: int = 2) -> service_pb2.ModelInferRequest:
    x = np.asarray([rng.uniform(-3, 3) for _ in range(rows * IN)], np.float32)
    req = service_pb2.ModelInferRequest(model_name=name)
    tensor = req.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, IN])
    tensor.contents.fp32_contents.extend(x.tolist())
    return req


def mutate(rng: random.Random, req: service_pb2.ModelInferRequest) -> bytes:
    tensor = req.inputs[0]
    choice = rng.randrange(14)
    if choice == 0:
        tensor.datatype = rng.choice(["INT8", "BYTES", "FP64", "BOOL", "fp32", "", "FP16", "UINT64"])
    elif choice == 1:
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[], [-1, IN], [2**40, IN], [0, IN], [2, IN, 1], [3, IN]]))
    elif choice == 2:
        del tensor.contents.fp32_contents[rng.randrange(len(tensor.contents.fp32_contents)) :]
    elif choice == 3:
        req.raw_input_contents.append(bytes(rng.randrange(256) for _ in range(rng.choice([0, 7, 4 * IN * 2]))))
    elif choice == 4:
        tensor.contents.int_contents.extend([1, 2, 3])
    elif choice == 5:
        req.outputs.add(name=rng.choice(["NOPE", "", "OUTPUT0"]))
    elif choice == 6:
        tensor.name = rng.choice(["INPUT1", "", "\u00e9", "x" * 300])
    elif choice == 7:
        req.model_version = rng.choice(["9", "x", "-1", "1"])
    elif choice == 8:
        req.parameters["p"].string_param = "x" * rng.randrange(100)
    elif choice == 9:
        req.inputs.add().CopyFrom(tensor)  # the same input twice
    elif choice == 10:
        del req.inputs[:]
    elif choice == 11:
        wire = req.SerializeToString()
        return wire[: rng.randrange(len(wire))]  # truncated
    elif choice == 12:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(100)))  # not protobuf
    else:
        other = rng.choice(["b-lin", "nope", "", "a-lin"])
        return req.SerializeToString() + service_pb2.ModelInferRequest(model_name=other).SerializeToString()
    return bytes(req.SerializeToString())


def generate(rng: random.Random, t: Target) -> tuple[str, bytes, tuple[tuple[str, str], ...]]:
    method = "ModelInfer" if rng.random() < 0.7 else rng.choice([*METHODS, "RepositoryIndex", "Nope"])
    if method == "ModelInfer":
        wire = mutate(rng, infer_request(rng)) if rng.random() < 0.85 else infer_request(rng).SerializeToString()
    elif rng.random() < 0.2:
        wire = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
    else:
        wire = service_pb2.ModelReadyRequest(name=rng.choice(["a-lin", "b-lin", "nope", ""])).SerializeToString()
    key = rng.choices([t.key_a, t.key_b, None, "garbage"], [80, 8, 6, 6])[0]
    metadata: list[tuple[str, str]] = [] if key is None else [("authorization", f"Bearer {key}")]
    if rng.random() < 0.05:
        metadata.append((HEADER, "forged"))
    return method, wire, tuple(metadata)


def invoke(
    channel: grpc.Channel, method: str, wire: bytes, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, bytes]:
    try:
        answer: bytes = channel.unary_unary(SERVICE + method)(wire, timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), (exc.details() or "").encode()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, answer


@pytest.fixture(scope="module")
def counts(target: Target) -> Counter[str]:
    rng = random.Random(20261201)
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + BUDGET_S
    with grpc.insecure_channel(target.gateway) as gateway, grpc.insecure_channel(target.replica) as replica:
        for i in range(CASES):
            if time.monotonic() > deadline:
                break
            method, wire, metadata = generate(rng, target)
            counts["tried"] += 1
            code, answer = invoke(gateway, method, wire, metadata)
            if code is grpc.StatusCode.OK:
                counts["OK"] += 1
            elif code in CLIENT_ERRORS:
                counts["clean client error"] += 1
            elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                counts["hangs"] += 1
                print(f"HANG case {i}: {method} {wire[:80]!r}")
            else:
                direct_metadata = (*((k, v) for k, v in metadata if k != HEADER), (HEADER, target.secret))
                direct, _ = invoke(replica, method, wire, direct_metadata)
                answered_by_gateway = method.startswith("Server")  # the gateway answers server-level calls itself
                who = "replica" if direct == code and not answered_by_gateway else "gateway"
                counts[f"server error ({who})"] += 1
                print(f"server error ({who}) case {i}: {method} {code.name} {answer[:160]!r} <- {wire[:80]!r}")
    return counts


def test_grpc_fuzz(target: Target, counts: Counter[str]) -> None:
    print("gRPC fuzz:", dict(counts))
    assert counts["tried"] >= min(CASES, 500)
    assert counts["hangs"] == 0
    assert counts["server error (gateway)"] == 0, dict(counts)
    with grpc.insecure_channel(target.gateway) as channel:  # the cloud keeps serving
        req = infer_request(random.Random(3))
        answer = channel.unary_unary(SERVICE + "ModelInfer")(
            req.SerializeToString(), timeout=10, metadata=(("authorization", f"Bearer {target.key_a}"),)
        )
    out = service_pb2.ModelInferResponse.FromString(answer)
    x = np.asarray(req.inputs[0].contents.fp32_contents, np.float32).reshape(2, IN)
    got = np.frombuffer(out.raw_output_contents[0], np.float32).reshape(2, -1)
    np.testing.assert_allclose(got, expected_output(x), rtol=1e-4)


def test_grpc_fuzz_replica_answers_are_clean(counts: Counter[str]) -> None:
    assert counts["server error (replica)"] == 0, f"the replica answered malformed calls with a server error: {counts}"


def test_the_key_is_checked_before_the_message_and_big_messages_are_refused(target: Target) -> None:
    big = service_pb2.ModelInferRequest(model_name="a-lin", raw_input_contents=[b"\0" * (80 * MIB)])
    wire = big.SerializeToString()
    with grpc.insecure_channel(target.gateway, options=[("grpc.max_send_message_length", -1)]) as channel:
        code, _ = invoke(channel, "ModelInfer", wire, ())
        assert code is grpc.StatusCode.UNAUTHENTICATED  # not RESOURCE_EXHAUSTED: the body was never taken in
        code, details = invoke(channel, "ModelInfer", wire, (("authorization", f"Bearer {target.key_a}"),))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        ok, _ = invoke(channel, "ModelReady", service_pb2.ModelReadyRequest(name="a-lin").SerializeToString(),
                       (("authorization", f"Bearer {target.key_a}"),))  # fmt: skip
        assert ok is grpc.StatusCode.OK


def test_routing_follows_the_model_name_protobuf_reads(target: Target) -> None:
    """Tenant a's key with "a-lin" first and "b-lin" last: the replica would serve b-lin, so it is b's, not a's."""
    req = infer_request(random.Random(4))
    wire = req.SerializeToString() + service_pb2.ModelInferRequest(model_name="b-lin").SerializeToString()
    with grpc.insecure_channel(target.gateway) as channel:
        code, _ = invoke(channel, "ModelInfer", wire, (("authorization", f"Bearer {target.key_a}"),))
        assert code is grpc.StatusCode.NOT_FOUND  # b-lin is b's: hidden from a, whichever name comes first
        code, _ = invoke(channel, "ModelInfer", wire, (("authorization", f"Bearer {target.key_b}"),))
        assert code is grpc.StatusCode.OK


FIXED = [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "ModelInfer"), (":authority", "gateway"),
         ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip


def _cased(rng: random.Random, name: str) -> str:
    """``name`` lower case mostly, else with some letters in capitals."""
    if rng.random() < 0.6:
        return name
    return "".join(c.upper() if rng.random() < 0.5 else c for c in name)


def raw_case(rng: random.Random, key: str, limit: int) -> tuple[list[tuple[str, str]], bool, int]:
    """Metadata for one raw call: the key, a few fields from a pool (the internal names and credentials among
    them), names in mixed case, and often a pad that brings the list within a few bytes of a limit (the
    gateway's, or a frame's 16 KiB, so that the block needs CONTINUATION). Returns it, whether a name is not
    lower case, and the list's size as HTTP/2 counts it."""
    pool = ["x-request-id", "x-octacloud-tenant", "x-octacloud-replica", "x-octacloud-internal", "cookie",
            "proxy-authorization", "user-agent", "grpc-timeout", "x-trace"]  # fmt: skip
    fields = [(_cased(rng, "authorization"), f"Bearer {key}")]
    fields += [
        (_cased(rng, rng.choice(pool)), rng.choice(["1", "victim", "bogus", "9S"])) for _ in range(rng.randrange(4))
    ]
    if rng.random() < 0.7:
        target = rng.choice([limit, limit, 16384, 2 * 16384]) + rng.randrange(-64, 65)
        room = target - sum(len(k) + len(v) + 32 for k, v in [*FIXED, *fields]) - 32 - len("x-pad")
        if room > 0:
            fields.append((_cased(rng, "x-pad"), "p" * room))
    size = sum(len(k) + len(v) + 32 for k, v in [*FIXED, *fields])
    return fields, any(k != k.lower() for k, _ in fields), size


def test_raw_header_fuzz_names_in_any_case_and_lists_near_every_limit(target: Target) -> None:
    """Seeded raw calls (``tests/h2wire.py``) whose header names are in mixed case and whose lists sit within
    64 bytes of the gateway's limit or of a frame's size, several on each connection: a name not in lower case
    is refused as malformed (INTERNAL), a list over the limit RESOURCE_EXHAUSTED (that is checked first), every
    other call is served; each on its own stream, no connection is closed, no call hangs, and the cloud stays
    ready."""
    import asyncio

    import httpx

    from tests import h2wire

    limit = target.cloud.cloud.config.limits.max_header_bytes
    rng = random.Random(20261203)
    message = h2wire.message(infer_request(rng).SerializeToString())
    outcomes: Counter[str] = Counter()

    async def connection(cases: list[tuple[list[tuple[str, str]], bool, int]]) -> None:
        wire = await h2wire.H2Wire.open(int(target.cloud.cloud.grpc_port))
        try:
            for i, (fields, upper, size) in enumerate(cases):
                sid = 1 + 2 * i
                block = hpack.Encoder().encode([*FIXED, *fields], huffman=False)  # hpack's Huffman is slow
                await wire.send(
                    h2wire.header_frames(sid, block) + h2wire.frame(h2wire.DATA, h2wire.END_STREAM, sid, message)
                )
                frames = await wire.read_until(lambda fs, sid=sid: "grpc-status" in h2wire.statuses(fs).get(sid, {}))
                got = h2wire.statuses(frames).get(sid, {})
                want = "8" if size > limit else "13" if upper else "0"  # the size is checked first
                outcomes["as expected" if got.get("grpc-status") == want else f"{want} -> {got}"] += 1
            assert h2wire.goaway(h2wire.parse(wire.received)) is None
        finally:
            wire.close()

    async def run() -> None:
        cases = [raw_case(rng, target.key_a, limit) for _ in range(240)]
        await asyncio.gather(*(connection(cases[i : i + 40]) for i in range(0, len(cases), 40)))

    asyncio.run(run())
    assert outcomes == Counter({"as expected": 240}), outcomes
    assert httpx.get(f"{target.cloud.url}/v2/health/ready", timeout=10).status_code == 200
