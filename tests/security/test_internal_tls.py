"""Internal TLS on the gateway → replica hop: the cloud's own CA, a certificate per replica, mutual TLS.

A replica given TLS files answers a client of its own cloud (REST, gRPC and metrics), refuses plain text, a
client without a certificate, a client of another cloud and a client that checks for another CA or another
replica; garbage or silence on its ports harms no other client. The CA's files are private and kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from octacloud.core.errors import InvalidSpecError
from octacloud.protocols.internal import ReplicaTls
from octacloud.protocols.server import ReplicaServer, ServerSettings
from octacloud.security import internal_auth
from octacloud.security.internal_tls import (
    FOLDER,
    REPLICA_CERT_LIFETIME,
    InternalCa,
    InternalClientTls,
    InternalTlsMode,
    Renewals,
    replica_server_name,
)
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import CloudThread, config, ready_ids, replica_env, wait_until

X = (np.arange(2 * IN, dtype=np.float32).reshape(2, IN) - 7) / 5
REPLICA = "linear-0a1b2c"


def test_the_ca_is_made_once_private_and_kept(tmp_path: Path) -> None:
    ca = InternalCa.ensure(tmp_path)
    key = tmp_path / FOLDER / "ca.key"
    assert key.stat().st_mode & 0o777 == 0o600 and (tmp_path / FOLDER).stat().st_mode & 0o777 == 0o700
    again = InternalCa.ensure(tmp_path)  # a restart keeps it: replicas that outlived the restart stay trusted
    assert again.ca_pem == ca.ca_pem
    key.chmod(0o644)
    with pytest.raises(InvalidSpecError, match="readable by others"):
        InternalCa.ensure(tmp_path)
    key.chmod(0o600)
    (tmp_path / FOLDER / "ca.pem").write_bytes(InternalCa.ensure(tmp_path / "other").ca_pem)
    with pytest.raises(InvalidSpecError, match="not the key of ca.pem"):
        InternalCa.ensure(tmp_path)


def test_processes_that_start_together_agree_on_one_ca(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        cas = list(pool.map(lambda _: InternalCa.ensure(tmp_path).ca_pem, range(8)))
    assert len(set(cas)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [FOLDER]


def test_a_replica_certificate_names_its_address_and_itself_and_is_short_lived(tmp_path: Path) -> None:
    now = 1_900_000_000.0
    ca = InternalCa.ensure(tmp_path, now=lambda: now)
    creds = ca.issue_replica(REPLICA, ["10.1.2.3"])
    cert = x509.load_pem_x509_certificate(creds.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [replica_server_name(REPLICA)]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    assert cert.not_valid_after_utc == dt.datetime.fromtimestamp(now, dt.UTC) + REPLICA_CERT_LIFETIME
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.issue_replica(REPLICA, ["10.1.2.3"]).cert_pem != creds.cert_pem  # every launch: a fresh key
    files = creds.write(tmp_path / "r", "replica")
    assert files.keyfile.stat().st_mode & 0o777 == 0o600
    hostname = ca.issue_replica("r2", ["node-7.internal"]).cert_pem
    names = x509.load_pem_x509_certificate(hostname).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "node-7.internal" in names.value.get_values_for_type(x509.DNSName)


def test_the_mode_turns_tls_on_where_replicas_may_be_remote() -> None:
    assert InternalTlsMode.AUTO.enabled(True) and not InternalTlsMode.AUTO.enabled(False)
    assert InternalTlsMode.ON.enabled(False) and not InternalTlsMode.OFF.enabled(True)
    assert InternalTlsMode.parse("ON") is InternalTlsMode.ON
    with pytest.raises(InvalidSpecError, match="auto, on or off"):
        InternalTlsMode.parse("yes")


def test_a_key_others_may_read_is_refused_by_the_replica(tmp_path: Path) -> None:
    files = InternalCa.ensure(tmp_path).issue_replica(REPLICA, ["127.0.0.1"]).write(tmp_path / "r", "replica")
    files.keyfile.chmod(0o644)
    with pytest.raises(InvalidSpecError, match="readable by others"):
        files.server_context()


@dataclass
class TlsReplica:
    server: ReplicaServer
    ca: InternalCa
    client: InternalClientTls
    secret: str
    root: Path

    @property
    def headers(self) -> dict[str, str]:
        return {internal_auth.HEADER: self.secret}

    def url(self, port: int | None, path: str) -> str:
        return f"https://127.0.0.1:{port}{path}"


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsReplica]:
    root = tmp_path_factory.mktemp("internal-tls")
    write_linear_model(root / "models")
    secret_file = root / internal_auth.FILE_NAME
    secret = internal_auth.ensure_secret(secret_file)
    ca = InternalCa.ensure(root / "state")
    files = ca.issue_replica(REPLICA, ["127.0.0.1"]).write(root / "replica", "replica")
    settings = ServerSettings(
        repository=root / "models",
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        internal_secret_file=secret_file,
        tls=files,
    )
    server = ReplicaServer(settings)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=60)
    try:
        yield TlsReplica(server, ca, InternalClientTls.issue(ca, root / "state"), secret, root)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def infer_body(x: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def test_a_client_of_the_cloud_is_answered_on_rest_grpc_and_metrics(replica: TlsReplica) -> None:
    import tritonclient.grpc as grpcclient

    s, verify = replica.server, replica.client.context()
    with httpx.Client(verify=verify, timeout=10, headers=replica.headers) as client:
        assert client.get(replica.url(s.http_port, "/v2/health/ready")).status_code == 200
        answer = client.post(replica.url(s.http_port, "/v2/models/linear/infer"), json=infer_body(X))
        assert answer.status_code == 200, answer.text
        out = np.array(answer.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, -1)
        np.testing.assert_allclose(out, expected_output(X), rtol=1e-5, atol=1e-5)
        metrics = client.get(replica.url(s.metrics_port, "/metrics"))
        assert metrics.status_code == 200 and "nv_inference_count" in metrics.text
        assert (
            client.get(replica.url(s.metrics_port, "/metrics"), headers={internal_auth.HEADER: ""}).status_code == 401
        )

    files = replica.client.files  # gRPC over TLS (ALPN h2) with the cloud's client certificate
    assert files is not None
    g = grpcclient.InferenceServerClient(
        f"127.0.0.1:{s.grpc_port}",
        ssl=True,
        root_certificates=str(files.client_ca),
        private_key=str(files.keyfile),
        certificate_chain=str(files.certfile),
    )
    try:
        inp = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        out = g.infer("linear", [inp], headers=replica.headers).as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, expected_output(X), rtol=1e-5, atol=1e-5)
    finally:
        g.close()


def test_plain_text_is_refused_on_every_port(replica: TlsReplica) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    s = replica.server
    for port in (s.http_port, s.metrics_port):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", headers=replica.headers, timeout=5)
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
    try:
        with pytest.raises(InferenceServerException):
            g.is_server_live(client_timeout=5)
    finally:
        g.close()


def _context(trust: bytes, cert: ReplicaTls | None) -> ssl.SSLContext:
    """A client that trusts ``trust`` only (and checks the server's name), presenting ``cert``."""
    context = ssl.create_default_context(cadata=trust.decode())
    if cert is not None:
        context.load_cert_chain(cert.certfile, cert.keyfile)
    return context


def _refused(replica: TlsReplica, context: ssl.SSLContext, server_name: str = "127.0.0.1") -> bool:
    """True when a TLS exchange with the replica's REST port fails (at the handshake or on the first read)."""
    try:
        with (
            socket.create_connection(("127.0.0.1", replica.server.http_port or 0), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=server_name) as tls,
        ):
            tls.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            return not tls.recv(100).startswith(b"HTTP/1.1 200")
    except (ssl.SSLError, OSError):
        return True


def test_clients_that_are_not_of_this_cloud_are_refused(replica: TlsReplica, tmp_path: Path) -> None:
    ours = replica.client.files
    assert ours is not None
    assert not _refused(replica, _context(replica.ca.ca_pem, ours))  # the control: ours is answered
    assert not _refused(replica, _context(replica.ca.ca_pem, ours), replica_server_name(REPLICA))
    # a client with no certificate
    assert _refused(replica, _context(replica.ca.ca_pem, None))
    # a second cloud: its client certificate is not of our CA (even trusting ours for the server)
    other = InternalCa.ensure(tmp_path / "other-cloud")
    theirs = InternalClientTls.issue(other, tmp_path / "other-cloud").files
    assert theirs is not None
    assert _refused(replica, _context(replica.ca.ca_pem, theirs))
    # a client that trusts another CA does not accept our replica
    assert _refused(replica, _context(other.ca_pem, ours))
    # a client that expects another replica does not accept this one
    assert _refused(replica, _context(replica.ca.ca_pem, ours), replica_server_name("linear-ffffff"))
    # a replica's certificate (server use only) is no client certificate
    sibling = replica.ca.issue_replica("linear-999999", ["127.0.0.1"]).write(tmp_path / "sibling", "replica")
    assert _refused(replica, _context(replica.ca.ca_pem, sibling))


def test_garbage_and_silence_on_the_ports_harm_no_other_client(replica: TlsReplica) -> None:
    s = replica.server
    ports = [s.http_port or 0, s.grpc_port or 0, s.metrics_port or 0]
    silent = [socket.create_connection(("127.0.0.1", p), timeout=5) for p in ports for _ in range(3)]
    try:
        for port in ports:
            for junk in (
                b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",  # plain HTTP to a TLS port
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # plain HTTP/2
                b"\x16\x03\x01\x00\x05garbage" + bytes(range(256)),  # a handshake record with nonsense
            ):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    reply = b""
                    with contextlib.suppress(OSError):  # refused: closed or reset, never answered
                        raw.sendall(junk)
                        raw.shutdown(socket.SHUT_WR)
                        while chunk := raw.recv(4096):
                            reply += chunk
                    assert b"HTTP/1.1 200" not in reply and b"nv_inference" not in reply
        # the silent connections are still open (their handshakes never finished): the others are answered anyway
        with httpx.Client(verify=replica.client.context(), timeout=10, headers=replica.headers) as client:
            for port, path in ((s.http_port, "/v2/health/ready"), (s.metrics_port, "/metrics")):
                assert client.get(replica.url(port, path)).status_code == 200
        assert all(sock.fileno() != -1 for sock in silent)
    finally:
        for sock in silent:
            sock.close()


@pytest.fixture(scope="module")
def tls_cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    root = tmp_path_factory.mktemp("tls-cloud")
    write_linear_model(root / "models")
    cfg = config(root, root / "models")
    cfg.internal_tls = InternalTlsMode.ON  # local replicas too (the default turns it on for Ray only)
    c = CloudThread(cfg)
    try:
        created = c.admin("POST", "/deployments", {"name": "linear", "model": "linear", "octants": 2})
        assert created.status_code == 201, created.text
        wait_until("a ready replica", lambda: len(ready_ids(c, "linear")) == 1)
        yield c
    finally:
        c.stop(stop_replicas=True)


def _instance(c: CloudThread) -> dict[str, Any]:
    [instance] = [i for i in c.deployment("linear")["instances"] if i["state"] == "ready"]
    return instance


def _serial(c: CloudThread, replica_id: str) -> int:
    pem = (c.cloud.config.state_dir / "replicas" / replica_id / "replica.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem).serial_number


@pytest.mark.slow
def test_the_gateway_forwards_through_internal_tls_as_a_direct_call_answers(tls_cloud: CloudThread) -> None:
    import tritonclient.grpc as grpcclient

    c, r = tls_cloud, _instance(tls_cloud)
    tls = c.cloud.internal_tls
    assert tls is not None
    env = replica_env(r["pid"])
    assert env["OCTACLOUD_INTERNAL_TLS_CERT"].endswith(f"{r['id']}/replica.pem")
    assert Path(env["OCTACLOUD_INTERNAL_TLS_KEY"]).stat().st_mode & 0o777 == 0o600
    internal = {internal_auth.HEADER: c.cloud.internal_secret}
    body = infer_body(X)
    direct = httpx.post(
        f"https://127.0.0.1:{r['http_port']}/v2/models/linear/infer", json=body, headers=internal, verify=tls
    )
    through = httpx.post(f"{c.url}/v2/models/linear/infer", json=body, headers=c.auth, timeout=30)
    assert direct.status_code == through.status_code == 200, through.text
    assert direct.json() == through.json()
    with pytest.raises(httpx.HTTPError):  # the replica itself speaks TLS only
        httpx.post(f"http://127.0.0.1:{r['http_port']}/v2/models/linear/infer", json=body, headers=internal, timeout=5)

    assert c.cloud.internal_ca is not None
    files = InternalClientTls.issue(c.cloud.internal_ca, c.cloud.config.state_dir / "test-client").files
    assert files is not None
    answers = []
    for target, meta, secure in (
        (f"127.0.0.1:{c.cloud.grpc_port}", {"authorization": f"Bearer {c.key}"}, False),
        (f"127.0.0.1:{r['grpc_port']}", internal, True),
    ):
        tls_args: dict[str, Any] = (
            {"ssl": True, "root_certificates": str(files.client_ca), "private_key": str(files.keyfile),
             "certificate_chain": str(files.certfile)} if secure else {}
        )  # fmt: skip
        g = grpcclient.InferenceServerClient(target, **tls_args)
        try:
            inp = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
            inp.set_data_from_numpy(X)
            answers.append(g.infer("linear", [inp], headers=meta).as_numpy("OUTPUT0"))
        finally:
            g.close()
    np.testing.assert_array_equal(answers[0], answers[1])
    np.testing.assert_allclose(answers[0], expected_output(X), rtol=1e-5, atol=1e-5)
    # the usage meter and the replica telemetry scrape over TLS too
    wait_until("a scrape of the replica's metrics", lambda: r["id"] in c._run(c.cloud.usage.work()), timeout=20)


@pytest.mark.slow
def test_a_replica_killed_and_restarted_gets_a_new_certificate_and_is_trusted(tls_cloud: CloudThread) -> None:
    c, old = tls_cloud, _instance(tls_cloud)
    serial = _serial(c, old["id"])
    os.kill(old["pid"], signal.SIGKILL)
    wait_until("the replica restarted", lambda: (r := _instance_or_none(c)) is not None and r["pid"] != old["pid"])
    new = _instance(c)
    assert _serial(c, new["id"]) != serial
    through = httpx.post(f"{c.url}/v2/models/linear/infer", json=infer_body(X), headers=c.auth, timeout=30)
    assert through.status_code == 200, through.text


def _instance_or_none(c: CloudThread) -> dict[str, Any] | None:
    ready = [i for i in c.deployment("linear")["instances"] if i["state"] == "ready"]
    return ready[0] if ready else None


def test_up_refuses_an_unknown_internal_tls_mode(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from octacloud.cli.main import app

    (tmp_path / "models").mkdir()
    args = ["up", "--repository", str(tmp_path / "models"), "--state-dir", str(tmp_path), "--internal-tls", "yes"]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert result.exit_code == 2 and "internal TLS must be auto, on or off, got 'yes'" in result.output


def test_the_prober_trusts_only_the_replica_it_expects(replica: TlsReplica, tmp_path: Path) -> None:
    from octacloud.control.deployments import Replica
    from octacloud.control.probes import HttpProber

    s = replica.server
    headers = [(internal_auth.HEADER_BYTES, replica.secret.encode())]

    async def probe(replica_id: str, tls: ssl.SSLContext | None) -> bool:
        prober = HttpProber(headers=headers, tls=tls)
        try:
            answer = await prober.probe(
                Replica(replica_id, "linear", host="127.0.0.1", http_port=s.http_port), "linear", 5
            )
        finally:
            await prober.close()
        return answer.ready

    other = InternalClientTls.issue(InternalCa.ensure(tmp_path / "other-cloud"), tmp_path / "other-cloud")
    assert asyncio.run(probe(REPLICA, replica.client.context()))
    assert not asyncio.run(probe("linear-ffffff", replica.client.context()))  # another replica's address
    assert not asyncio.run(probe(REPLICA, other.context()))  # another cloud
    assert not asyncio.run(probe(REPLICA, None))  # plain text


def test_certificates_past_half_their_life_are_renewed(tmp_path: Path) -> None:
    clock = [1_900_000_000.0]
    renewals = Renewals(InternalCa.ensure(tmp_path, now=lambda: clock[0]), lifetime=dt.timedelta(hours=2))
    first = renewals.issue("r1", ["10.0.0.1"])
    renewals.track("h1", "r1", ["10.0.0.1"])
    renewals.track("h2", "r2", ["10.0.0.2"])
    clock[0] += 3599
    assert renewals.due() == []
    clock[0] += 1
    due = renewals.due()
    assert [(h, r) for h, r, _ in due] == [("h1", "r1"), ("h2", "r2")]
    renewed = x509.load_pem_x509_certificate(due[0][2].cert_pem)
    assert renewed.serial_number != x509.load_pem_x509_certificate(first.cert_pem).serial_number
    assert renewed.not_valid_after_utc == dt.datetime.fromtimestamp(clock[0], dt.UTC) + dt.timedelta(hours=2)
    assert renewals.due() == []  # not again until half the new life has passed
    renewals.forget("h2")
    clock[0] += 3600
    assert [h for h, _, _ in renewals.due()] == ["h1"]
    # a replica an earlier run started: its certificate's age is unknown, so it is renewed at once
    assert renewals.adopt("h3", "r3", ["10.0.0.3"]) and not renewals.adopt("h1", "r1", ["10.0.0.1"])
    assert [h for h, _, _ in renewals.due()] == ["h3"]


def _served_serial(port: int, context: ssl.SSLContext) -> int:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_running_replica_loads_its_renewed_certificate(tmp_path: Path) -> None:
    write_linear_model(tmp_path / "models")
    week_ago = time.time() - 8 * 86400  # its first certificate has expired: clients refuse it
    old_ca = InternalCa.ensure(tmp_path / "state", now=lambda: week_ago)
    files = old_ca.issue_replica(REPLICA, ["127.0.0.1"]).write(tmp_path / "replica", "replica")
    settings = ServerSettings(repository=tmp_path / "models", http_port=0, grpc_port=0, metrics_port=0, tls=files,
                              internal_secret_file=None, tls_reload_s=0.05)  # fmt: skip
    server = ReplicaServer(settings)
    await server.start()
    try:
        ca = InternalCa.ensure(tmp_path / "state")  # the same CA, today's clock
        context = InternalClientTls.issue(ca, tmp_path / "state").context()
        ports = [server.http_port or 0, server.grpc_port or 0, server.metrics_port or 0]
        for port in ports:
            with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
                await asyncio.to_thread(_served_serial, port, context)
        renewed = ca.issue_replica(REPLICA, ["127.0.0.1"])
        renewed.write(tmp_path / "replica", "replica")
        serial = x509.load_pem_x509_certificate(renewed.cert_pem).serial_number
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(ssl.SSLError):
                if await asyncio.to_thread(_served_serial, ports[0], context) == serial:
                    break
            await asyncio.sleep(0.05)
        for port in ports:  # REST, gRPC and metrics all serve the new one, without a restart
            assert await asyncio.to_thread(_served_serial, port, context) == serial
        async with httpx.AsyncClient(verify=context) as client:
            assert (await client.get(f"https://127.0.0.1:{ports[0]}/v2/health/ready")).status_code == 200
    finally:
        await server.stop()


def test_the_local_launcher_renews_the_certificates_of_its_replicas(tmp_path: Path) -> None:
    from octacloud.control.launcher import LaunchSpec, LocalProcessLauncher

    repo = tmp_path / "models"
    write_linear_model(repo)
    clock = [time.time()]
    launcher = LocalProcessLauncher(
        tmp_path / "replicas", internal_ca=InternalCa.ensure(tmp_path, now=lambda: clock[0])
    )
    launched = launcher.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    try:
        pem = tmp_path / "replicas" / "r1" / "replica.pem"
        first = x509.load_pem_x509_certificate(pem.read_bytes()).serial_number
        assert launcher.renew_certificates() == 0
        clock[0] += REPLICA_CERT_LIFETIME.total_seconds() / 2
        assert launcher.renew_certificates() == 1
        assert x509.load_pem_x509_certificate(pem.read_bytes()).serial_number != first
        assert (tmp_path / "replicas" / "r1" / "replica.key").stat().st_mode & 0o777 == 0o600
    finally:
        launcher.stop(launched.handle, 2.0)
    clock[0] += REPLICA_CERT_LIFETIME.total_seconds()
    assert launcher.renew_certificates() == 0  # a stopped replica is forgotten


def test_a_replica_adopted_from_an_earlier_run_is_renewed(tmp_path: Path) -> None:
    from octacloud.control.launcher import LaunchSpec, LocalProcessLauncher

    repo = tmp_path / "models"
    write_linear_model(repo)
    ca = InternalCa.ensure(tmp_path)
    earlier = LocalProcessLauncher(tmp_path / "replicas", internal_ca=ca)
    launched = earlier.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    later = LocalProcessLauncher(tmp_path / "replicas", internal_ca=ca)  # a restarted controller
    try:
        pem = tmp_path / "replicas" / "r1" / "replica.pem"
        first = x509.load_pem_x509_certificate(pem.read_bytes()).serial_number
        assert later.renew_certificates() == 0  # it does not know the replica yet
        later.adopt_certificate(launched.handle, "r1", "127.0.0.1")
        assert later.renew_certificates() == 1
        assert x509.load_pem_x509_certificate(pem.read_bytes()).serial_number != first
    finally:
        later.stop(launched.handle, 2.0)


def test_ray_replicas_bind_loopback_on_the_gateway_node_only(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from octacloud.control.ray.backend import RayFleet, RayLauncher

    launcher = RayLauncher(RayFleet(lambda: []), "models", tmp_path, gateway_host="10.0.0.1")
    assert launcher.bind_address("10.0.0.1") == "127.0.0.1"  # the gateway's own node: nothing else needs it
    assert launcher.bind_address("10.0.0.2") == "10.0.0.2"  # another node: its address in the cluster


def test_the_replica_offers_http1_on_rest_and_h2_on_grpc(replica: TlsReplica) -> None:
    assert replica.client.files is not None
    context = _context(replica.ca.ca_pem, replica.client.files)
    context.set_alpn_protocols(["h2", "http/1.1"])
    for port, expected in ((replica.server.http_port, "http/1.1"), (replica.server.grpc_port, "h2")):
        with (
            socket.create_connection(("127.0.0.1", port or 0), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=replica_server_name(REPLICA)) as tls,
        ):
            assert tls.selected_alpn_protocol() == expected
            assert tls.version() in ("TLSv1.2", "TLSv1.3")


@pytest.mark.slow
def test_a_restarted_cloud_renews_the_certificates_of_the_replicas_it_adopts(tmp_path: Path) -> None:
    write_linear_model(tmp_path / "models")
    cfg = config(tmp_path, tmp_path / "models")
    cfg.internal_tls = InternalTlsMode.ON
    first = CloudThread(cfg)
    try:
        assert first.admin("POST", "/deployments", {"name": "linear", "model": "linear"}).status_code == 201
        wait_until("a ready replica", lambda: len(ready_ids(first, "linear")) == 1)
        [replica_id] = ready_ids(first, "linear")
        pid = _instance(first)["pid"]
    finally:
        first.stop(stop_replicas=False)  # the replica keeps running, as after a restart of `octacloud up`
    serial = _serial(first, replica_id)
    second = CloudThread(cfg)
    try:
        wait_until("the adopted replica's certificate renewed", lambda: _serial(second, replica_id) != serial, 20)
        assert ready_ids(second, "linear") == {replica_id} and _instance(second)["pid"] == pid  # adopted
        through = httpx.post(f"{second.url}/v2/models/linear/infer", json=infer_body(X), headers=second.auth)
        assert through.status_code == 200, through.text
    finally:
        second.stop(stop_replicas=True)
