"""The options of ``octacloud up`` and their checks: from the command line to the cloud's :class:`CloudConfig`.

Each option is one ``typer.Option`` here (its flag, default and help); ``up`` names them in its signature and
hands what it was given to :func:`cloud_config` as one :class:`UpOptions`. A wrong value stops the command with
exit status 2 and an error that names the option, before anything starts. A new option is its constant here, a
field of :class:`UpOptions` and a parameter of ``up`` of the same name (``tests/cli/test_up.py`` checks the last
two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from octacloud.cli.cloud import err
from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS

if TYPE_CHECKING:
    from octacloud.app import CloudConfig
    from octacloud.control.emulated import EmulationSettings

REPOSITORY = typer.Option(Path("models"), "--repository", "-r", help="Model repository (Triton layout).")
FLEET = typer.Option(
    None, "--fleet", help="Fleet file (YAML, see docs/cloud.md); default: this host's GPUs, else a demo fleet."
)
STATE_DIR = typer.Option(Path("var"), "--state-dir", help="Where the state store and replica logs live.")
HOST = typer.Option("127.0.0.1", "--host", help="Address the gateway binds.")
HTTP_PORT = typer.Option(8000, "--http-port", help="Gateway port for OIP REST, the admin API, dashboard.")
GRPC_PORT = typer.Option(8001, "--grpc-port", help="Gateway port for OIP gRPC.")
POLICY = typer.Option("octacloud", "--policy", help="Scheduling profile (built-in name or file).")
INTERVAL = typer.Option(5.0, "--interval", help="Seconds between reconcile passes.")
CPU_NODES = typer.Option(
    2, "--cpu-nodes", help="Without GPUs or --fleet: nodes of the demo fleet carved out of this host (1: the host)."
)
CPU_CARDS = typer.Option(4, "--cpu-cards", help="Without GPUs or --fleet: CPU 'cards' per node.")
DEPLOY = typer.Option(
    [],
    "--deploy",
    help="Once up, deploy MODEL (1 replica on the smallest slice that holds it) unless a deployment of that name "
    "exists.",
)
DEPLOY_MAX_REPLICAS = typer.Option(
    DEFAULT_MAX_REPLICAS,
    "--deploy-max-replicas",
    help="How far `scale` may take a model deployed by --deploy (the default is `deploy`'s too).",
)
TLS_CERT = typer.Option(None, "--tls-cert", help="Serve REST and gRPC over TLS with this cert.")
TLS_KEY = typer.Option(None, "--tls-key", help="The TLS certificate's private key.")
TLS_CLIENT_CA = typer.Option(None, "--tls-client-ca", help="Require client certs from this CA.")
ALLOW_INSECURE = typer.Option(False, "--allow-insecure", help="Allow plain text off loopback.")
METER_INTERVAL = typer.Option(10.0, "--meter-interval", help="Seconds per usage-ledger interval.")
PRICES = typer.Option(None, "--prices", help="Price sheet (YAML) for usage reports.")
TELEMETRY_INTERVAL = typer.Option(
    1.0, "--telemetry-interval", help="Seconds between GPU telemetry samples (the dashboard and the scheduler)."
)
BACKEND = typer.Option("local", "--backend", help="Where replicas run: local (this machine) or ray.")
RAY_ADDRESS = typer.Option(
    None, "--ray-address", "--ray", help="The Ray cluster (HOST:PORT; default: auto). Implies --backend ray."
)
MODEL_STORAGE = typer.Option(
    None,
    "--model-storage",
    help="The model store replicas fetch from into their node's cache: a folder, "
    "s3://bucket/prefix (any S3-compatible endpoint) or another fsspec URL (docs/storage.md). Default: "
    "--repository, served in place.",
)
STORAGE_CREDENTIALS = typer.Option(
    None,
    "--storage-credentials",
    help="S3 credentials file (AWS format; may name endpoint_url) for "
    "--model-storage (default: AWS_* variables, AWS_PROFILE, ~/.aws).",
)
MODEL_CACHE = typer.Option(
    None, "--model-cache", help="The node model cache folder (on Ray: <folder>/<node>; default: STATE/model-cache)."
)
MODEL_CACHE_SIZE = typer.Option(
    None, "--model-cache-size", help="Each node cache's size limit, e.g. 50GiB (default: no limit)."
)
WARM_COPIES = typer.Option(
    0, "--warm-copies", help="Nodes per deployment that keep its model cached for failovers (docs/storage.md)."
)
LIMIT = typer.Option([], "--limit", help="Gateway bound NAME=VALUE (docs/security.md); repeatable.")
GATEWAY_WORKERS = typer.Option(
    1,
    "--gateway-workers",
    help="Processes serving the REST and gRPC ports (SO_REUSEPORT), apart from the controller's; 0: the "
    "controller's own process (docs/gateway.md, Gateway workers).",
)
INTERNAL_TLS = typer.Option(
    "auto", "--internal-tls", help="TLS from the gateway to replicas: auto (on Ray), on, off (docs/security.md)."
)
EMULATE = typer.Option(
    False,
    "--emulate",
    help="Emulated replicas: real OIP endpoints with no model compute, many per process "
    "(docs/fleet-scale.md); for fleets this machine could never hold.",
)
EMULATED_LATENCY_MS = typer.Option(2.0, "--emulated-latency-ms", help="With --emulate: each batch's latency.")
EMULATED_LOAD_MS = typer.Option(0.0, "--emulated-load-ms", help="With --emulate: each model's load time.")
EMULATED_HOSTS = typer.Option(4, "--emulated-hosts", help="With --emulate: processes the replicas share.")


@dataclass(frozen=True, slots=True)
class UpOptions:
    """What ``octacloud up`` was given, as typer parsed it (before any check)."""

    repository: Path
    fleet: Path | None
    state_dir: Path
    host: str
    http_port: int
    grpc_port: int
    policy: str
    interval: float
    cpu_nodes: int
    cpu_cards: int
    deploy: list[str]
    deploy_max_replicas: int
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    allow_insecure: bool
    meter_interval: float
    prices: Path | None
    telemetry_interval: float
    backend: str
    ray_address: str | None
    model_storage: str | None
    storage_credentials: Path | None
    model_cache: Path | None
    model_cache_size: str | None
    warm_copies: int
    limit: list[str]
    gateway_workers: int
    internal_tls: str
    emulate: bool
    emulated_latency_ms: float
    emulated_load_ms: float
    emulated_hosts: int

    @property
    def on_ray(self) -> bool:
        """Whether the replicas run on Ray (``--backend ray`` or a ``--ray-address``)."""
        return self.backend == "ray" or self.ray_address is not None


def _usage(message: str) -> NoReturn:
    err.print(f"[red]error:[/] {message}")
    raise typer.Exit(2)


def _check_plain(o: UpOptions) -> None:
    """The checks that need nothing parsed: intervals, spin windows, the repository, backend, TLS pair."""
    from octacloud.idlespin import GATEWAY_SPIN_ENV, REPLICA_SPIN_ENV, window_us_from_env

    for flag, value in (("--interval", o.interval), ("--meter-interval", o.meter_interval),
                        ("--telemetry-interval", o.telemetry_interval)):  # fmt: skip
        if not value > 0:
            _usage(f"{flag} must be a positive number of seconds, got {value:g}")
    for name in (GATEWAY_SPIN_ENV, REPLICA_SPIN_ENV):  # the replicas it starts read the second
        try:
            window_us_from_env(name)
        except ValueError as exc:
            _usage(str(exc))
    if o.model_storage is None and not o.repository.is_dir():
        _usage(f"model repository {o.repository} does not exist (build the examples: make models)")


def _emulation(o: UpOptions) -> EmulationSettings | None:
    """``--emulate``'s settings (None without it), checked."""
    if not o.emulate:
        return None
    from octacloud.control.emulated import EmulationSettings
    from octacloud.core.errors import OctacloudError
    from octacloud.serving.emulated import EmulatedLatency

    if o.on_ray:
        _usage("--emulate runs replicas on this machine: it does not go with --backend ray")
    try:
        latency = EmulatedLatency(o.emulated_latency_ms)
        return EmulationSettings(latency, load_ms=o.emulated_load_ms, hosts=o.emulated_hosts)
    except (ValueError, OctacloudError) as exc:
        _usage(str(exc))


def cloud_config(o: UpOptions) -> CloudConfig:
    """The cloud ``o`` asks for, once every option is checked (else exit 2 naming the first wrong one)."""
    from octacloud.app import CloudConfig
    from octacloud.control.controller import ControllerSettings
    from octacloud.core.errors import OctacloudError
    from octacloud.gateway.limits import GatewayLimits
    from octacloud.security.internal_tls import InternalTlsMode
    from octacloud.security.tls import TlsConfig
    from octacloud.storage.sizes import parse_size

    _check_plain(o)
    try:
        cache_size = parse_size(o.model_cache_size) if o.model_cache_size is not None else None
    except OctacloudError as exc:
        _usage(str(exc))
    if o.backend not in ("local", "ray"):
        _usage(f"--backend must be local or ray, got {o.backend!r}")
    if (o.tls_cert is None) != (o.tls_key is None):
        _usage("--tls-cert and --tls-key go together")
    try:
        limits = GatewayLimits.parse(o.limit)
        internal_tls_mode = InternalTlsMode.parse(o.internal_tls)
    except OctacloudError as exc:
        _usage(str(exc))
    if o.gateway_workers < 0:
        _usage(f"--gateway-workers must be 0 (the cloud's own process) or more, got {o.gateway_workers}")
    if o.deploy_max_replicas < 1:
        _usage(f"--deploy-max-replicas must be at least 1, got {o.deploy_max_replicas}")
    return CloudConfig(
        repository=o.repository,
        state_dir=o.state_dir,
        fleet_file=o.fleet,
        host=o.host,
        http_port=o.http_port,
        grpc_port=o.grpc_port,
        policy=o.policy,
        cpu_cards=o.cpu_cards,
        cpu_nodes=o.cpu_nodes,
        controller=ControllerSettings(interval_s=o.interval),
        tls=TlsConfig(o.tls_cert, o.tls_key, o.tls_client_ca)
        if o.tls_cert is not None and o.tls_key is not None
        else None,
        allow_insecure=o.allow_insecure,
        meter_interval_s=o.meter_interval,
        telemetry_interval_s=o.telemetry_interval,
        prices=o.prices,
        ray_address=o.ray_address,
        model_storage=o.model_storage,
        storage_credentials=o.storage_credentials,
        model_cache=o.model_cache,
        model_cache_size=cache_size,
        warm_copies=max(0, o.warm_copies),
        limits=limits,
        gateway_workers=o.gateway_workers,
        internal_tls=internal_tls_mode,
        emulation=_emulation(o),
    )
