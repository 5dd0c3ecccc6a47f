"""TLS for the gateway (REST and gRPC), a development CA, and the rule that plain text stays on loopback.

``make_dev_certs(folder)`` writes a local CA (``ca.pem``, ``ca.key``), a server certificate for
``127.0.0.1``, ``::1`` and ``localhost`` signed by it (``server.pem``, ``server.key``) and a client
certificate (``client.pem``, ``client.key``) for trying client-certificate authentication. Keys are written
with mode 0600. They are for trying TLS on one machine, not for production.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from octacloud.core.errors import InvalidSpecError

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True, slots=True)
class TlsConfig:
    certfile: Path
    keyfile: Path
    client_ca: Path | None = None
    """When set, clients must present a certificate signed by this CA (mutual TLS)."""

    def check(self) -> None:
        for what, path in (("certificate", self.certfile), ("key", self.keyfile), ("client CA", self.client_ca)):
            if path is not None and not path.is_file():
                raise InvalidSpecError(f"TLS {what} {path} does not exist (make a dev set: octacloud certs dev)")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, ValueError) as exc:
            raise InvalidSpecError(
                f"TLS certificate {self.certfile} and key {self.keyfile} do not load: {exc}"
            ) from None

    def grpc_credentials_args(self) -> tuple[list[tuple[bytes, bytes]], bytes | None, bool]:
        """Arguments of ``grpc.ssl_server_credentials``: (key, chain) pairs, root certificates, require client."""
        pair = [(self.keyfile.read_bytes(), self.certfile.read_bytes())]
        root = self.client_ca.read_bytes() if self.client_ca is not None else None
        return pair, root, root is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, tls: TlsConfig | None, allow_insecure: bool) -> None:
    """Plain text only on loopback, unless the operator says so."""
    if tls is None and not is_loopback(host) and not allow_insecure:
        raise InvalidSpecError(
            f"refusing to serve plain HTTP/gRPC on {host}: API keys would cross the network in clear. "
            "Give --tls-cert and --tls-key (try: octacloud certs dev), bind 127.0.0.1, or pass --allow-insecure"
        )


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    days: int,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "octacloud dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, subject)])  # fmt: skip
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_dev_certs(folder: Path, days: int = 30, force: bool = False) -> dict[str, Path]:
    """Write a dev CA, a loopback server certificate and a client certificate into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {n: folder / n for n in ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")}
    existing = [p.name for p in paths.values() if p.exists()]
    if existing and not force:
        raise InvalidSpecError(f"{folder} already holds {', '.join(existing)}; pass --force to replace them")
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _cert("octacloud dev CA", ca_key, None, days, ca=True)
    server = _cert("localhost", server_key, (ca.subject, ca_key), days, server=True)
    client = _cert("octacloud dev client", client_key, (ca.subject, ca_key), days)
    for name, cert, key in (("ca", ca, ca_key), ("server", server, server_key), ("client", client, client_key)):
        _write(paths[f"{name}.pem"], cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(paths[f"{name}.key"], _pem_key(key), private=True)
    return paths
