"""Header names in any case and header lists near every limit, sent raw to a real cloud's gRPC front by one
tenant while another tenant's REST and gRPC traffic is measured alongside.

HTTP/2 field names are lower case (RFC 9113 8.2.1): a call that names a field otherwise is malformed and is
refused on its own stream, so ``X-Octacloud-Replica``, ``X-Octacloud-Tenant`` or ``Authorization`` written
with capitals never reach a replica. A header list is accepted by the gateway up to ``max_header_bytes`` and
refused beyond it on its own stream; what the gateway forwards (that list, less credentials and internal names,
plus its own fields) is always within what a replica accepts, so no call can make a replica close the gateway's
shared connection to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from octacloud.app import CloudConfig
from tests import h2wire
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, wait_until

from .conftest import call, make_tenant

pytestmark = pytest.mark.slow

X = np.arange(2 * IN, dtype=np.float32).reshape(2, IN) / 10
INFER = h2wire.SERVICE + "ModelInfer"


@dataclass
class Setup:
    cloud: CloudThread
    victim: str
    attacker: str

    @property
    def grpc_port(self) -> int:
        return int(self.cloud.cloud.grpc_port)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("h2-headers")
    write_linear_model(root / "models")
    cfg = config(root, root / "models")
    cfg.limits = replace(cfg.limits, max_inflight_per_replica=64)  # the bursts below are not load to shed
    with victim_and_attacker(cfg) as s:
        yield s


@contextmanager
def victim_and_attacker(cfg: CloudConfig) -> Iterator[Setup]:
    """A cloud of ``cfg`` with two tenants, the victim's published deployment ``v-lin`` ready."""
    c = CloudThread(cfg)
    try:
        victim, attacker = make_tenant(c, "victim"), make_tenant(c, "attacker")
        body = {"name": "v-lin", "model": "linear", "published": True}
        assert call(c, victim, "POST", "/admin/deployments", body).status_code == 201
        wait_until("the victim's deployment ready", lambda: bool(ready_ids(c, "v-lin")))
        yield Setup(c, victim, attacker)
    finally:
        c.stop(stop_replicas=True)


def infer_message(name: str = "v-lin") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=name)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, IN])
    tensor.contents.fp32_contents.extend(X.ravel().tolist())
    return bytes(request.SerializeToString())


@dataclass
class VictimTraffic:
    """The victim's REST and gRPC inference in a thread, until told to stop (at least ``least`` of each)."""

    setup: Setup
    least: int = 20
    ok: int = 0
    attempts: int = 0
    failed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> VictimTraffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(120)

    def _run(self) -> None:
        s = self.setup
        url = f"{s.cloud.url}/v2/models/v-lin/infer"
        body = {"inputs": [{"name": "INPUT0", "shape": [2, IN], "datatype": "FP32", "data": X.ravel().tolist()}]}
        headers = {"Authorization": f"Bearer {s.victim}"}
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        tensor = grpcclient.InferInput("INPUT0", [2, IN], "FP32")
        tensor.set_data_from_numpy(X)
        want = expected_output(X)
        done = 0
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set() or done < self.least:
                done += 1
                self.attempts = done
                try:
                    r = http.post(url, json=body, headers=headers)
                    if r.status_code != 200:
                        self.failed.append(f"REST {r.status_code}: {r.text[:200]}")
                    else:
                        self.ok += 1
                    out = client.infer("v-lin", [tensor], headers={"authorization": f"Bearer {s.victim}"})
                    np.testing.assert_allclose(out.as_numpy("OUTPUT0"), want, rtol=1e-5)
                    self.ok += 1
                except Exception as exc:
                    self.failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        client.close()


def attack(port: int, calls: Callable[[h2wire.H2Wire], object]) -> None:
    async def go() -> None:
        wire = await h2wire.H2Wire.open(port)
        try:
            await calls(wire)  # type: ignore[misc]
        finally:
            wire.close()

    asyncio.run(go())


def test_internal_and_credential_names_in_capitals_are_refused_and_never_reach_a_replica(setup: Setup) -> None:
    """The attack of issue 33 item 1: another tenant's published deployment, ``X-Octacloud-Replica: bogus`` (the
    replica refused, the gateway ejected it and the owner's REST got 503), ``X-Octacloud-Tenant: victim`` (the
    attacker's rows batched as the victim's) and ``Authorization`` with a capital A (the key reached the
    replica). Each such call is refused on its stream, naming the field; the victim's calls, sent in between on
    the same gateway, all succeed."""
    key = f"Bearer {setup.attacker}"
    bogus = [("authorization", key), ("X-Octacloud-Replica", "bogus")]
    refused = [bogus] * 6 + [[("authorization", key), ("X-Octacloud-Tenant", "victim")], [("Authorization", key)]]
    control = [("authorization", key), ("x-octacloud-replica", "bogus"), ("x-octacloud-internal", "guess")]
    mine = [("authorization", f"Bearer {setup.victim}")]
    answers: dict[int, dict[str, str]] = {}
    victims: dict[int, dict[str, str]] = {}
    rounds = 0

    async def calls(wire: h2wire.H2Wire) -> None:
        nonlocal rounds
        own = await h2wire.H2Wire.open(setup.grpc_port)
        sid = 1
        while rounds < 10 or victim.attempts < 20:  # the attack lasts while the victim calls over REST too
            out = b"".join(h2wire.call(sid + 2 * i, INFER, m, infer_message()) for i, m in enumerate(refused))
            out += h2wire.call(sid + 2 * len(refused), INFER, control, infer_message())
            await own.send(h2wire.call(1 + 4 * rounds, INFER, mine, infer_message()))
            await wire.send(out)  # one write: the calls arrive together, as the did
            await own.send(h2wire.call(3 + 4 * rounds, INFER, mine, infer_message()))
            sid += 2 * (len(refused) + 1)
            rounds += 1
            expected = rounds
            await wire.read_until(lambda fs, n=expected: len(h2wire.statuses(fs)) >= n * (len(refused) + 1))
            await own.read_until(lambda fs, n=expected: len(h2wire.statuses(fs)) >= 2 * n)
        answers.update(h2wire.statuses(h2wire.parse(wire.received)))
        victims.update(h2wire.statuses(h2wire.parse(own.received)))
        own.close()

    traffic = setup.cloud.cloud.routes.traffic
    before = traffic[("attacker", "v-lin")].requests if ("attacker", "v-lin") in traffic else 0
    with VictimTraffic(setup) as victim:
        attack(setup.grpc_port, calls)
    assert victim.failed == [] and victim.ok >= 40
    assert len(victims) == 2 * rounds and all(h["grpc-status"] == "0" for h in victims.values()), victims
    per_round = len(refused) + 1
    assert len(answers) == rounds * per_round
    for sid, headers in answers.items():
        if ((sid - 1) // 2) % per_round == len(refused):  # all lower case: the client's copies are dropped
            assert headers["grpc-status"] == "0", headers
            continue
        assert headers["grpc-status"] == "13", headers  # INTERNAL: a malformed request
        assert "lower case" in headers["grpc-message"], headers
    assert traffic[("attacker", "v-lin")].requests - before == rounds  # the served calls, billed to the attacker


def test_header_lists_near_the_limit_are_refused_on_their_stream_and_never_break_the_shared_hop(
    setup: Setup,
) -> None:
    """The attack of issue 33 item 2: calls whose metadata is within a few hundred bytes of the gateway's 64 KiB,
    on either side, each sent between two of the victim's calls (which share the gateway's connection to the
    replica). Each is served or refused RESOURCE_EXHAUSTED on its own stream; the attacker's connection keeps
    serving, and every call of the victim's succeeds, over gRPC and REST."""
    limit = setup.cloud.cloud.config.limits.max_header_bytes
    key = ("authorization", f"Bearer {setup.attacker}")
    fixed = sum(len(k) + len(v) + 32 for k, v in [(":method", "POST"), (":scheme", "http"), (":path", INFER),
                (":authority", "gateway"), ("content-type", "application/grpc"), ("te", "trailers"), key])  # fmt: skip
    sizes = [limit - fixed - 32 - len("x-pad") + d for d in range(-400, 401, 25)]
    mine = [("authorization", f"Bearer {setup.victim}")]
    answers: dict[int, dict[str, str]] = {}
    victims: dict[int, dict[str, str]] = {}

    async def calls(wire: h2wire.H2Wire) -> None:
        own = await h2wire.H2Wire.open(setup.grpc_port)
        for i, n in enumerate(sizes):
            await own.send(h2wire.call(1 + 4 * i, INFER, mine, infer_message()))
            await wire.send(h2wire.call(1 + 2 * i, INFER, [key, ("x-pad", "p" * n)], infer_message()))
            await own.send(h2wire.call(3 + 4 * i, INFER, mine, infer_message()))
            await wire.read_until(lambda fs, i=i: len(h2wire.statuses(fs)) > i)
            await own.read_until(lambda fs, i=i: len(h2wire.statuses(fs)) >= 2 * (i + 1))
        after = 1 + 2 * len(sizes)
        await wire.send(h2wire.call(after, INFER, [key], infer_message()))  # the connection still serves
        frames = await wire.read_until(lambda fs: after in h2wire.statuses(fs))
        answers.update(h2wire.statuses(frames))
        victims.update(h2wire.statuses(h2wire.parse(own.received)))
        assert h2wire.goaway(frames) is None
        own.close()

    with VictimTraffic(setup, least=10) as victim:
        attack(setup.grpc_port, calls)
    assert victim.failed == []
    assert len(victims) == 2 * len(sizes) and all(h["grpc-status"] == "0" for h in victims.values()), victims
    for i, n in enumerate(sizes):
        headers = answers[1 + 2 * i]
        size = fixed + len("x-pad") + n + 32
        if size <= limit:
            assert headers["grpc-status"] == "0", (size, headers)
        else:
            assert headers["grpc-status"] == "8", (size, headers)  # RESOURCE_EXHAUSTED
            assert f"over the limit of {limit}" in headers["grpc-message"], headers
    assert answers[1 + 2 * len(sizes)]["grpc-status"] == "0"


def test_the_forwarded_headers_drop_internal_names_and_credentials_in_any_case() -> None:
    """The one policy both fronts apply, on str (gRPC) and bytes (REST) names."""
    from octacloud.protocols.headers import forwarded

    sent = [("X-Octacloud-Tenant", "t"), ("AUTHORIZATION", "Bearer k"), ("Proxy-Authorization", "p"),
            ("x-octacloud-internal", "s"), ("X-OCTACLOUD-REPLICA", "r"), ("Cookie", "c"),
            ("x-request-id", "7")]  # fmt: skip
    assert forwarded(sent) == [("x-request-id", "7")]
    assert forwarded([(k.encode(), v.encode()) for k, v in sent]) == [(b"x-request-id", b"7")]


def test_every_hop_accepts_what_the_hop_before_it_accepted() -> None:
    """One table: the gateway's header bound plus what it adds stays within the replicas' bound, and a gateway
    configured past that is refused before it starts."""
    from octacloud.core.errors import InvalidSpecError
    from octacloud.gateway.limits import GatewayLimits
    from octacloud.protocols import headers

    limits = GatewayLimits()
    assert limits.max_header_bytes + headers.INTERNAL_HEADER_BYTES <= headers.REPLICA_MAX_HEADER_BYTES
    with pytest.raises(InvalidSpecError, match="max_header_bytes"):
        GatewayLimits(max_header_bytes=headers.REPLICA_MAX_HEADER_BYTES)
