"""Internal TLS: the per-cloud CA with which the gateway and its replicas know each other across machines.

Each cloud has its own certificate authority, made at first start in ``<state>/internal-tls/`` (``ca.pem``;
``ca.key`` with mode 0600) and kept across restarts, so that replicas that outlive a restart stay trusted.

- Every replica launch gets a fresh server certificate (:meth:`InternalCa.issue_replica`), valid for
  :data:`REPLICA_CERT_LIFETIME`, naming the address the replica binds (an IP or DNS SAN) and the replica
  itself (``<replica id>.replica.octacloud``, see :func:`replica_server_name`). A restarted replica gets a
  new one; the old key dies with the old process. Past half its life the launcher hands a running replica
  a new one (:class:`Renewals`), which the replica loads for its next handshakes without a restart.
- The gateway (and the prober, the scrapers) present a client certificate of the same CA
  (:meth:`InternalCa.client_credentials`, re-issued at each start), and replicas require it: a replica
  answers only handshakes from its own cloud, a client trusts only replicas of its own cloud.

The per-cloud internal secret (``cluster.internal_auth``) is still sent and checked on top: TLS keeps it
from crossing the network in clear.

When the hop is protected is :class:`InternalTlsMode`: ``auto`` turns it on where replicas may run on another
machine (the Ray launcher) and off for local loopback processes, where the secret suffices.
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from octacloud.core.errors import InvalidSpecError
from octacloud.protocols.internal import ReplicaTls
from octacloud.security.tls import _key, _pem_key, _write

FOLDER = "internal-tls"
"""The CA's folder in the cloud's state directory."""
CA_LIFETIME = dt.timedelta(days=3650)
REPLICA_CERT_LIFETIME = dt.timedelta(days=7)
"""A replica's certificate: longer than a replica usually lives; a replica restarted gets a new one."""
CLIENT_CERT_LIFETIME = dt.timedelta(days=365)
"""The gateway's client certificate: issued at every start of the cloud, kept in memory. Whoever could steal it
can read the CA's key in the same state directory, so a shorter life would protect nothing more."""
RENEW_INTERVAL_S = 3600.0
"""How often a cloud looks for replica certificates past half their life."""
CLOCK_SKEW = dt.timedelta(minutes=5)
"""Certificates are valid from this long before they are made (machines' clocks differ a little)."""


class InternalTlsMode(enum.StrEnum):
    """Whether the gateway → replica hop runs over TLS: ``auto`` (on when replicas may be on another machine:
    the Ray launcher; off for local processes on loopback), ``on``, ``off``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, value: str) -> InternalTlsMode:
        try:
            return cls(value.lower())
        except ValueError:
            raise InvalidSpecError(f"internal TLS must be auto, on or off, got {value!r}") from None

    def enabled(self, replicas_may_be_remote: bool) -> bool:
        if self is InternalTlsMode.AUTO:
            return replicas_may_be_remote
        return self is InternalTlsMode.ON


def replica_server_name(replica_id: str) -> str:
    """The DNS name a replica's certificate carries besides its address (what a client can check it against)."""
    return f"{replica_id}.replica.octacloud"


@dataclass(frozen=True, slots=True)
class Credentials:
    """A certificate, its private key and the CA that signed it, as PEM."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes

    def write(self, folder: Path, name: str) -> ReplicaTls:
        """Write ``<name>.pem``, ``<name>.key`` (0600) and ``ca.pem`` into ``folder``; returns the files."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = ReplicaTls(folder / f"{name}.pem", folder / f"{name}.key", folder / "ca.pem")
        # Each file is replaced whole (written aside, then renamed), the certificate last: a running replica
        # that sees a new certificate file finds its key already in place (protocols/internal.py reloads).
        for path, data, private in (
            (paths.client_ca, self.ca_pem, False),
            (paths.keyfile, self.key_pem, True),
            (paths.certfile, self.cert_pem, False),
        ):
            aside = path.with_name(path.name + ".new")
            _write(aside, data, private)
            os.chmod(aside, 0o600 if private else 0o644)
            os.replace(aside, path)
        return paths


class InternalCa:
    """The cloud's internal CA. ``now`` (seconds since the epoch) dates the certificates it issues."""

    def __init__(
        self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, now: Callable[[], float] = time.time
    ) -> None:
        self.cert = cert
        self._key = key
        self.now = now
        self.ca_pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def ensure(cls, state_dir: Path, now: Callable[[], float] = time.time) -> InternalCa:
        """The CA in ``state_dir/internal-tls``, made on first use; an existing one is kept (and checked)."""
        folder = state_dir / FOLDER
        if not (folder / "ca.key").exists():
            # Made whole in a folder of its own, then renamed into place: processes that start together agree
            # on one CA (the rename of a second one fails on the first one's non-empty folder).
            state_dir.mkdir(parents=True, exist_ok=True)
            aside = Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=state_dir))  # mode 0700
            key = _key()
            cert = _build(_name("octacloud internal CA"), key, None, now, CA_LIFETIME, ca=True)
            _write(aside / "ca.key", _pem_key(key), private=True)
            _write(aside / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
            try:
                os.rename(aside, folder)
            except OSError:  # another process made it first
                shutil.rmtree(aside, ignore_errors=True)
        return cls.load(folder, now)

    @classmethod
    def load(cls, folder: Path, now: Callable[[], float] = time.time) -> InternalCa:
        cert_path, key_path = folder / "ca.pem", folder / "ca.key"
        try:
            mode = key_path.stat().st_mode
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise InvalidSpecError(f"internal CA in {folder} does not load: {exc}") from None
        if mode & 0o077:
            raise InvalidSpecError(
                f"internal CA key {key_path} is readable by others (mode {mode & 0o777:o}); chmod it 600"
            )
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise InvalidSpecError(f"internal CA in {folder}: ca.key is not the key of ca.pem")
        return cls(cert, key, now)

    def issue_replica(
        self, replica_id: str, addresses: Sequence[str], lifetime: dt.timedelta = REPLICA_CERT_LIFETIME
    ) -> Credentials:
        """A server certificate for replica ``replica_id`` listening on ``addresses`` (IPs or host names)."""
        names: list[x509.GeneralName] = [x509.DNSName(replica_server_name(replica_id))]
        for address in addresses:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(address.strip("[]"))))
            except ValueError:
                names.append(x509.DNSName(address))
        return self._issue(f"replica {replica_id}", names, lifetime, server=True)

    def client_credentials(self, lifetime: dt.timedelta = CLIENT_CERT_LIFETIME) -> Credentials:
        """The client certificate the gateway, the prober and the scrapers present to replicas."""
        return self._issue("octacloud gateway", [], lifetime, server=False)

    def _issue(
        self, subject: str, names: list[x509.GeneralName], lifetime: dt.timedelta, *, server: bool
    ) -> Credentials:
        key = _key()
        cert = _build(_name(subject), key, (self.cert.subject, self._key), self.now, lifetime, names=names,
                      server=server)  # fmt: skip
        return Credentials(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), self.ca_pem)


@dataclass(slots=True)
class _Issued:
    replica_id: str
    addresses: tuple[str, ...]
    renew_at: float


class Renewals:
    """The certificates a launcher issued to the replicas it runs, and which are past half their life.

    ``issue`` before a launch, ``track`` once the launcher knows the replica's handle, ``forget`` at stop;
    ``due`` re-issues every tracked certificate past half its life and returns (handle, replica id, new
    credentials) for the launcher to hand over. A replica adopted from an earlier controller, whose
    certificate's age is unknown here, is tracked with ``adopt``: it is renewed at the next ``due``.
    """

    def __init__(self, ca: InternalCa, lifetime: dt.timedelta = REPLICA_CERT_LIFETIME) -> None:
        self.ca = ca
        self.lifetime = lifetime
        self._issued: dict[str, _Issued] = {}

    def issue(self, replica_id: str, addresses: Sequence[str]) -> Credentials:
        return self.ca.issue_replica(replica_id, addresses, self.lifetime)

    def track(self, handle: str, replica_id: str, addresses: Sequence[str]) -> None:
        half = self.lifetime.total_seconds() / 2
        self._issued[handle] = _Issued(replica_id, tuple(addresses), self.ca.now() + half)

    def adopt(self, handle: str, replica_id: str, addresses: Sequence[str]) -> bool:
        """Track a running replica this launcher did not start (due at once); False when already tracked."""
        if handle in self._issued:
            return False
        self._issued[handle] = _Issued(replica_id, tuple(addresses), self.ca.now())
        return True

    def forget(self, handle: str) -> None:
        self._issued.pop(handle, None)

    def due(self) -> list[tuple[str, str, Credentials]]:
        now = self.ca.now()
        out = []
        for handle, issued in self._issued.items():
            if now >= issued.renew_at:
                out.append((handle, issued.replica_id, self.issue(issued.replica_id, issued.addresses)))
                issued.renew_at = now + self.lifetime.total_seconds() / 2
        return out


@dataclass(frozen=True, slots=True)
class InternalClientTls:
    """The gateway side of internal TLS: what each client of replicas needs."""

    credentials: Credentials
    ssl_context: ssl.SSLContext
    files: ReplicaTls | None = None
    """The certificate, key and CA as files, when :meth:`issue` was asked to keep them (other clients' use)."""

    @classmethod
    def issue(cls, ca: InternalCa, keep_in: Path | None = None) -> InternalClientTls:
        """A fresh client certificate (one per process: each gateway process of a cloud makes its own). ``ssl``
        loads keys from files only: they are written to a private temporary folder, loaded and removed, unless
        ``keep_in`` names a folder to keep them in."""
        credentials = ca.client_credentials()
        if keep_in is not None:
            files = credentials.write(keep_in, "gateway")
            return cls(credentials, _client_context(credentials, files), files)
        with tempfile.TemporaryDirectory(prefix="octacloud-internal-tls-") as folder:  # mode 0700
            return cls(credentials, _client_context(credentials, credentials.write(Path(folder), "gateway")))

    def context(self) -> ssl.SSLContext:
        """The client context: trusts only the cloud CA, checks the replica's name, presents our certificate."""
        return self.ssl_context

    def grpc_credentials_args(self) -> tuple[bytes, bytes, bytes]:
        """``grpc.ssl_channel_credentials`` arguments: root certificates, private key, certificate chain."""
        return self.credentials.ca_pem, self.credentials.key_pem, self.credentials.cert_pem


def _client_context(credentials: Credentials, files: ReplicaTls) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=credentials.ca_pem.decode())
    context.load_cert_chain(files.certfile, files.keyfile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "octacloud"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def _build(
    name: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    now: Callable[[], float],
    lifetime: dt.timedelta,
    *,
    ca: bool = False,
    server: bool = False,
    names: Sequence[x509.GeneralName] = (),
) -> x509.Certificate:
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    start = dt.datetime.fromtimestamp(now(), dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - CLOCK_SKEW)
        .not_valid_after(start + lifetime)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
        builder = builder.add_extension(usage, critical=True)
        purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
        if issuer is not None:
            aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key())
            builder = builder.add_extension(aki, critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())
