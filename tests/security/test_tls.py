"""TLS: tritonclient over HTTPS and gRPC-with-TLS through the gateway; plain connections to the TLS ports fail
cleanly (quickly, with an error, and the server keeps serving); client certificates when required; plain text
off loopback is refused unless allowed."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from octacloud.app import Cloud, CloudConfig
from octacloud.core.errors import InvalidSpecError
from octacloud.security.tls import TlsConfig, make_dev_certs
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.cluster.test_cloud_e2e import FLEET, CloudThread, config, ready_ids, wait_until

pytestmark = pytest.mark.slow


def trust(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


class TlsCloud(CloudThread):
    def __init__(self, cfg: CloudConfig, ca: Path) -> None:
        self.ca = ca
        super().__init__(cfg)
        self.url = f"https://127.0.0.1:{self.cloud.http_port}"

    def admin(self, method: str, path: str, body: dict[str, object] | None = None) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin{path}", json=body, headers=self.auth, verify=trust(self.ca))


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    return make_dev_certs(tmp_path / "tls")


@pytest.fixture
def tls_cloud(tmp_path: Path, certs: dict[str, Path]) -> Iterator[TlsCloud]:
    repo = tmp_path / "models"
    write_linear_model(repo)
    cfg = config(tmp_path, repo)
    cfg.tls = TlsConfig(certs["server.pem"], certs["server.key"])
    c = TlsCloud(cfg, certs["ca.pem"])
    yield c
    c.stop(stop_replicas=True)


def test_tritonclient_over_tls_and_plain_fails_cleanly(tls_cloud: TlsCloud, certs: dict[str, Path]) -> None:
    c = tls_cloud
    assert c.admin("POST", "/deployments", {"name": "linear", "model": "linear"}).status_code == 201
    wait_until("the replica", lambda: len(ready_ids(c, "linear")) == 1)
    x = np.ones((2, IN), np.float32)
    headers = {"Authorization": f"Bearer {c.key}"}

    h = httpclient.InferenceServerClient(
        f"127.0.0.1:{c.cloud.http_port}",
        ssl=True,
        ssl_context_factory=lambda: ssl.create_default_context(cafile=str(certs["ca.pem"])),
    )
    inp = httpclient.InferInput("INPUT0", [2, IN], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    np.testing.assert_allclose(h.infer("linear", [inp], headers=headers).as_numpy("OUTPUT0"), expected_output(x), 1e-5)
    h.close()

    g = grpcclient.InferenceServerClient(
        f"localhost:{c.cloud.grpc_port}", ssl=True, root_certificates=str(certs["ca.pem"])
    )
    ginp = grpcclient.InferInput("INPUT0", [2, IN], "FP32")
    ginp.set_data_from_numpy(x)
    meta = {"authorization": f"Bearer {c.key}"}
    np.testing.assert_allclose(g.infer("linear", [ginp], headers=meta).as_numpy("OUTPUT0"), expected_output(x), 1e-5)
    g.close()

    # plain HTTP to the TLS port: an error, not a hang (each call below has its own deadline)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{c.cloud.http_port}/v2/health/live", timeout=10)
    # plain gRPC to the TLS port: UNAVAILABLE within the deadline
    plain = grpcclient.InferenceServerClient(f"127.0.0.1:{c.cloud.grpc_port}")
    with pytest.raises(InferenceServerException) as refused:
        plain.is_server_live(client_timeout=5)
    assert refused.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    plain.close()
    # a client that does not trust the CA is refused by its own TLS check
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{c.url}/v2/health/live", timeout=10)
    # and the server keeps serving TLS clients
    assert httpx.get(f"{c.url}/v2/health/ready", verify=trust(certs["ca.pem"])).status_code == 200


def test_client_certificates_when_required(tmp_path: Path, certs: dict[str, Path]) -> None:
    repo = tmp_path / "models"
    write_linear_model(repo)
    cfg = config(tmp_path, repo)
    cfg.tls = TlsConfig(certs["server.pem"], certs["server.key"], client_ca=certs["ca.pem"])
    c = TlsCloud(cfg, certs["ca.pem"])
    try:
        url = f"{c.url}/v2/health/live"
        ctx = ssl.create_default_context(cafile=str(certs["ca.pem"]))
        ctx.load_cert_chain(certs["client.pem"], certs["client.key"])
        assert httpx.get(url, verify=ctx).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=trust(certs["ca.pem"]), timeout=10)  # no client certificate
        g = grpcclient.InferenceServerClient(
            f"localhost:{c.cloud.grpc_port}",
            ssl=True,
            root_certificates=str(certs["ca.pem"]),
            private_key=str(certs["client.key"]),
            certificate_chain=str(certs["client.pem"]),
        )
        assert g.is_server_live()
        g.close()
        anonymous = grpcclient.InferenceServerClient(
            f"localhost:{c.cloud.grpc_port}", ssl=True, root_certificates=str(certs["ca.pem"])
        )
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=5)
        anonymous.close()
    finally:
        c.stop(stop_replicas=True)


def test_plain_text_off_loopback_needs_allow_insecure(tmp_path: Path, certs: dict[str, Path]) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    cfg = CloudConfig(repository=repo, state_dir=tmp_path / "var", host="0.0.0.0", http_port=0, grpc_port=0)
    with pytest.raises(InvalidSpecError, match="allow-insecure"):
        Cloud(cfg, nodes=FLEET)
    assert not (tmp_path / "var").exists()  # refused before anything was created
    cfg.tls = TlsConfig(certs["server.pem"], certs["ca.key"])  # a key that does not match the certificate
    with pytest.raises(InvalidSpecError, match="do not load"):
        Cloud(cfg, nodes=FLEET)
    cfg.tls = TlsConfig(tmp_path / "missing.pem", certs["server.key"])
    with pytest.raises(InvalidSpecError, match="octacloud certs dev"):
        Cloud(cfg, nodes=FLEET)


def test_dev_certs_are_private_and_not_overwritten(tmp_path: Path, certs: dict[str, Path]) -> None:
    assert oct(certs["server.key"].stat().st_mode & 0o777) == "0o600"
    assert oct(certs["ca.key"].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(InvalidSpecError, match="--force"):
        make_dev_certs(tmp_path / "tls")
    assert make_dev_certs(tmp_path / "tls", force=True)["ca.pem"].read_bytes() != b""
