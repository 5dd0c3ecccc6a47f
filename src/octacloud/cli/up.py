"""``octacloud up``: the cloud in the foreground (``octacloud down`` stops the replicas it leaves running).

``up`` holds a lock on ``<state-dir>/up.lock`` while it runs (it records its PID, backend and gateway there),
so that a second ``up`` on the same state and a ``down`` that would kill its live replicas refuse instead.
It logs one timed line per event the controller records (deployments, placements, replicas ready or failed,
preemptions, moves, scaling), and prints the dashboard's address and a ready-to-paste request.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import typer
from rich.table import Table

from octacloud.cli.cloud import console, err
from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS
from octacloud.database import private_folder

if TYPE_CHECKING:
    from octacloud.control.store import Store

LOCK_FILE = "up.lock"
EVENTS_LOGGER = "octacloud.events"


# ---- the lock that says `up` runs on a state dir --------------------------------------------------------


class CloudRunningError(RuntimeError):
    """``octacloud up`` holds the state dir's lock; ``holder`` is what it recorded (PID, backend, URL)."""

    def __init__(self, holder: dict[str, Any]) -> None:
        super().__init__(f"octacloud up (PID {holder.get('pid', '?')}) is running")
        self.holder = holder


@contextlib.contextmanager
def hold_up_lock(state_dir: Path, info: dict[str, Any]) -> Iterator[None]:
    """Hold ``<state_dir>/up.lock`` while the block runs, recording ``info`` in it; raises
    :class:`CloudRunningError` when another ``up`` holds it. The lock dies with the process (even kill -9)."""
    private_folder(state_dir)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    f: IO[str] = os.fdopen(fd, "r+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CloudRunningError(_read_record(f)) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "started_at": time.time(), **info}) + "\n")
        f.flush()
        yield
    finally:
        f.close()  # releases the lock; the record stays for `down` (the backend it ran on)


def up_record(state_dir: Path) -> tuple[bool, dict[str, Any]]:
    """Whether an ``up`` holds ``state_dir`` now, and what the last ``up`` recorded there ({} if none)."""
    path = state_dir / LOCK_FILE
    if not path.exists():
        return False, {}
    with path.open("r+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, _read_record(f)
        return False, _read_record(f)


def _read_record(f: IO[str]) -> dict[str, Any]:
    f.seek(0)
    try:
        data = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# ---- the event log ------------------------------------------------------------------------------------------


def event_line(event: dict[str, object]) -> str:
    """One event as ``up`` logs it: kind, subject, what happened."""
    return f"{event['kind']:<13} {event['subject']!s:<22} {event['message']}"


def log_events(store: Store) -> None:
    """Subscribe to ``store``'s events: each becomes one INFO line on the ``octacloud.events`` logger."""
    logger = logging.getLogger(EVENTS_LOGGER)
    store.subscribe(lambda event: logger.info("%s", event_line(event)))


class _Lines(logging.Formatter):
    """``HH:MM:SS message`` for events; the level and logger name too for everything else."""

    def format(self, record: logging.LogRecord) -> str:
        when = self.formatTime(record, "%H:%M:%S")
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.name == EVENTS_LOGGER:
            return f"{when} {text}"
        return f"{when} {record.levelname.lower():<7} {record.name}: {text}"


def configure_logging() -> None:
    """Timed lines on stderr, unless logging is configured already (as basicConfig: a host's handlers stay)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Lines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per metrics scrape and probe


# ---- a ready-to-paste request ---------------------------------------------------------------------------------

_SAMPLE = {"BOOL": True, "BYTES": "hello"}
_NUMPY = {"BOOL": "bool_", "BYTES": "object_", "FP16": "float16", "FP32": "float32", "FP64": "float64"}


def sample_inputs(store: Any, model: str) -> list[dict[str, Any]] | None:
    """Inputs of one sample request to ``model`` (name, shape, datatype, a value to fill it with), from its
    ``config.pbtxt`` in the model store; None when the config names no inputs."""
    from octacloud.serving.repository.config import datatype_of_enum, parse_config

    try:
        config = parse_config(store.read(model, "config.pbtxt").decode(), f"{store.url}/{model}/config.pbtxt")
    except Exception:  # no config, or one the replica would refuse anyway: no sample then
        return None
    if not config.input:
        return None
    batch = [1] if config.max_batch_size > 0 else []
    inputs = []
    for i in config.input:
        datatype = datatype_of_enum(i.data_type)
        shape = batch + [8 if d < 0 else int(d) for d in i.dims]
        value = _SAMPLE.get(datatype, 0.5 if datatype.startswith("FP") else 1)
        inputs.append({"name": i.name, "shape": shape, "datatype": datatype, "value": value})
    return inputs


def sample_requests(base: str, grpc: str, model: str, inputs: list[dict[str, Any]], key_file: Path) -> list[str]:
    """A curl command line (OIP REST) and a tritonclient one-liner (gRPC) that ask ``model`` once."""
    tensors = ", ".join(
        f'{{"name": {_lit(i["name"])}, "shape": {i["shape"]!r}, "datatype": {_lit(i["datatype"])}, '
        f'"data": [{_lit(i["value"])}] * {math.prod(i["shape"])}}}'
        for i in inputs
    )
    body = f'import json; print(json.dumps({{"inputs": [{tensors}]}}))'
    key = shlex.quote(str(key_file))
    python_bin = shlex.quote(interpreter())
    curl = (
        f"{python_bin} -c {shlex.quote(body)} | curl -s {base}/v2/models/{model}/infer "
        f'-H "Authorization: Bearer $(cat {key})" -H "Content-Type: application/json" -d @-'
    )
    arrays = ", ".join(f"g.InferInput({_lit(i['name'])}, {i['shape']!r}, {_lit(i['datatype'])})" for i in inputs)
    fills = "; ".join(
        f"x[{k}].set_data_from_numpy(np.full({i['shape']!r}, {_lit(i['value'])}, np.{_numpy_type(i['datatype'])}))"
        for k, i in enumerate(inputs)
    )
    headers = f'{{"authorization": "Bearer " + open({_lit(str(key_file))}).read().strip()}}'
    python = (
        f"import numpy as np, tritonclient.grpc as g; c = g.InferenceServerClient({_lit(grpc)}); x = [{arrays}]; "
        f"{fills}; r = c.infer({_lit(model)}, x, headers={headers}); "
        "print({o.name: r.as_numpy(o.name) for o in r.get_response().outputs})"
    )
    return [curl, f"{python_bin} -c {shlex.quote(python)}"]


def interpreter() -> str:
    """The Python that runs octacloud (it has tritonclient and numpy), as the user would type it: relative to
    the working folder when it is under it (``.venv/bin/python``), else its absolute path."""
    exe = Path(sys.executable)
    if not exe.is_absolute():
        return str(exe)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def _lit(value: object) -> str:
    """A Python literal in double quotes (so that the command line needs no escaped single quotes)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _numpy_type(datatype: str) -> str:
    return _NUMPY.get(datatype, datatype.lower())


# ---- up ---------------------------------------------------------------------------------------------------


def up(
    repository: Path = typer.Option(Path("models"), "--repository", "-r", help="Model repository (Triton layout)."),
    fleet: Path | None = typer.Option(
        None, "--fleet", help="Fleet file (YAML, see docs/cloud.md); default: this host's GPUs, else a demo fleet."
    ),
    state_dir: Path = typer.Option(Path("var"), "--state-dir", help="Where the state store and replica logs live."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the gateway binds."),
    http_port: int = typer.Option(8000, "--http-port", help="Gateway port for OIP REST, the admin API, dashboard."),
    grpc_port: int = typer.Option(8001, "--grpc-port", help="Gateway port for OIP gRPC."),
    policy: str = typer.Option("octacloud", "--policy", help="Scheduling profile (built-in name or file)."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between reconcile passes."),
    cpu_nodes: int = typer.Option(
        2, "--cpu-nodes", help="Without GPUs or --fleet: nodes of the demo fleet carved out of this host (1: the host)."
    ),
    cpu_cards: int = typer.Option(4, "--cpu-cards", help="Without GPUs or --fleet: CPU 'cards' per node."),
    deploy: list[str] = typer.Option(
        [],
        "--deploy",
        help="Once up, deploy MODEL (1 replica on the smallest slice that holds it) unless a deployment of that name "
        "exists.",
    ),
    deploy_max_replicas: int = typer.Option(
        DEFAULT_MAX_REPLICAS,
        "--deploy-max-replicas",
        help="How far `scale` may take a model deployed by --deploy (the default is `deploy`'s too).",
    ),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Serve REST and gRPC over TLS with this cert."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The TLS certificate's private key."),
    tls_client_ca: Path | None = typer.Option(None, "--tls-client-ca", help="Require client certs from this CA."),
    allow_insecure: bool = typer.Option(False, "--allow-insecure", help="Allow plain text off loopback."),
    meter_interval: float = typer.Option(10.0, "--meter-interval", help="Seconds per usage-ledger interval."),
    prices: Path | None = typer.Option(None, "--prices", help="Price sheet (YAML) for usage reports."),
    telemetry_interval: float = typer.Option(
        1.0, "--telemetry-interval", help="Seconds between GPU telemetry samples (the dashboard and the scheduler)."
    ),
    backend: str = typer.Option("local", "--backend", help="Where replicas run: local (this machine) or ray."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", "--ray", help="The Ray cluster (HOST:PORT; default: auto). Implies --backend ray."
    ),
    model_storage: str | None = typer.Option(
        None,
        "--model-storage",
        help="The model store replicas fetch from into their node's cache: a folder, "
        "s3://bucket/prefix (any S3-compatible endpoint) or another fsspec URL (docs/storage.md). Default: "
        "--repository, served in place.",
    ),
    storage_credentials: Path | None = typer.Option(
        None,
        "--storage-credentials",
        help="S3 credentials file (AWS format; may name endpoint_url) for "
        "--model-storage (default: AWS_* variables, AWS_PROFILE, ~/.aws).",
    ),
    model_cache: Path | None = typer.Option(
        None, "--model-cache", help="The node model cache folder (on Ray: <folder>/<node>; default: STATE/model-cache)."
    ),
    model_cache_size: str | None = typer.Option(
        None, "--model-cache-size", help="Each node cache's size limit, e.g. 50GiB (default: no limit)."
    ),
    warm_copies: int = typer.Option(
        0, "--warm-copies", help="Nodes per deployment that keep its model cached for failovers (docs/storage.md)."
    ),
    limit: list[str] = typer.Option([], "--limit", help="Gateway bound NAME=VALUE (docs/security.md); repeatable."),
    gateway_workers: int = typer.Option(
        1,
        "--gateway-workers",
        help="Processes serving the REST and gRPC ports (SO_REUSEPORT); 1: the cloud's own process "
        "(docs/gateway.md, Gateway workers).",
    ),
    internal_tls: str = typer.Option(
        "auto", "--internal-tls", help="TLS from the gateway to replicas: auto (on Ray), on, off (docs/security.md)."
    ),
    emulate: bool = typer.Option(
        False,
        "--emulate",
        help="Emulated replicas: real OIP endpoints with no model compute, many per process "
        "(docs/fleet-scale.md); for fleets this machine could never hold.",
    ),
    emulated_latency_ms: float = typer.Option(
        2.0, "--emulated-latency-ms", help="With --emulate: each batch's latency."
    ),
    emulated_load_ms: float = typer.Option(0.0, "--emulated-load-ms", help="With --emulate: each model's load time."),
    emulated_hosts: int = typer.Option(4, "--emulated-hosts", help="With --emulate: processes the replicas share."),
) -> None:
    """Run the cloud: fleet, controller, replicas on slices, and the OIP gateway (on this machine, or on Ray)."""
    from octacloud.app import Cloud, CloudConfig, ray_cloud
    from octacloud.control.controller import ControllerSettings
    from octacloud.core.errors import OctacloudError
    from octacloud.idlespin import GATEWAY_SPIN_ENV, REPLICA_SPIN_ENV, window_us_from_env
    from octacloud.security.tls import TlsConfig

    for flag, value in (("--interval", interval), ("--meter-interval", meter_interval),
                        ("--telemetry-interval", telemetry_interval)):  # fmt: skip
        if not value > 0:
            err.print(f"[red]error:[/] {flag} must be a positive number of seconds, got {value:g}")
            raise typer.Exit(2)
    for name in (GATEWAY_SPIN_ENV, REPLICA_SPIN_ENV):  # the replicas it starts read the second
        try:
            window_us_from_env(name)
        except ValueError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    if model_storage is None and not repository.is_dir():
        err.print(f"[red]error:[/] model repository {repository} does not exist (build the examples: make models)")
        raise typer.Exit(2)
    from octacloud.storage.sizes import parse_size

    try:
        cache_size = parse_size(model_cache_size) if model_cache_size is not None else None
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if backend not in ("local", "ray"):
        err.print(f"[red]error:[/] --backend must be local or ray, got {backend!r}")
        raise typer.Exit(2)
    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/] --tls-cert and --tls-key go together")
        raise typer.Exit(2)
    from octacloud.gateway.limits import GatewayLimits
    from octacloud.security.internal_tls import InternalTlsMode

    try:
        limits = GatewayLimits.parse(limit)
        internal_tls_mode = InternalTlsMode.parse(internal_tls)
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if gateway_workers < 1:
        err.print(f"[red]error:[/] --gateway-workers must be at least 1, got {gateway_workers}")
        raise typer.Exit(2)
    if deploy_max_replicas < 1:
        err.print(f"[red]error:[/] --deploy-max-replicas must be at least 1, got {deploy_max_replicas}")
        raise typer.Exit(2)
    emulation = None
    if emulate:
        from octacloud.control.emulated import EmulationSettings
        from octacloud.serving.emulated import EmulatedLatency

        if backend == "ray" or ray_address is not None:
            err.print("[red]error:[/] --emulate runs replicas on this machine: it does not go with --backend ray")
            raise typer.Exit(2)
        try:
            latency = EmulatedLatency(emulated_latency_ms)
            emulation = EmulationSettings(latency, load_ms=emulated_load_ms, hosts=emulated_hosts)
        except (ValueError, OctacloudError) as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    config = CloudConfig(
        repository=repository,
        state_dir=state_dir,
        fleet_file=fleet,
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        policy=policy,
        cpu_cards=cpu_cards,
        cpu_nodes=cpu_nodes,
        controller=ControllerSettings(interval_s=interval),
        tls=TlsConfig(tls_cert, tls_key, tls_client_ca) if tls_cert is not None and tls_key is not None else None,
        allow_insecure=allow_insecure,
        meter_interval_s=meter_interval,
        telemetry_interval_s=telemetry_interval,
        prices=prices,
        ray_address=ray_address,
        model_storage=model_storage,
        storage_credentials=storage_credentials,
        model_cache=model_cache,
        model_cache_size=cache_size,
        warm_copies=max(0, warm_copies),
        limits=limits,
        gateway_workers=gateway_workers,
        internal_tls=internal_tls_mode,
        emulation=emulation,
    )
    on_ray = backend == "ray" or ray_address is not None
    scheme = "https" if config.tls is not None else "http"

    async def main() -> None:
        configure_logging()
        try:
            cloud = ray_cloud(config) if on_ray else Cloud(config)
        except OctacloudError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        log_events(cloud.store)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, cloud.request_stop)
        from octacloud.cli.down import adopted, left_running

        before = cloud.controller.store.replicas()  # what the previous `up` left
        await cloud.start()  # (the controller adopts what still runs before start returns)
        _print_fleet_summary(cloud)
        for model in deploy:
            _deploy_once(cloud, model, deploy_max_replicas)
        base = f"{scheme}://{host}:{cloud.http_port}"
        console.print(
            f"octacloud is up: OIP REST {base}  gRPC {host}:{cloud.grpc_port}  dashboard {base}/dashboard/\n"
            "  (Ctrl-C stops the cloud; replicas keep running until `octacloud down`)",
            soft_wrap=True,
            highlight=False,
        )
        if cloud.admin_key is not None:
            console.print(
                f"admin API key (shown once; also in {state_dir / 'admin.key'}, mode 0600):\n  {cloud.admin_key}",
                soft_wrap=True,
            )
        _print_sample(cloud, deploy, base, f"{host}:{cloud.grpc_port}", state_dir / "admin.key")
        if found := adopted(before, cloud.controller.store.replicas()):
            console.print(found, soft_wrap=True, highlight=False)
        await cloud.serve_forever()
        console.print(left_running(cloud.controller.store.replicas(), state_dir), soft_wrap=True, highlight=False)

    from octacloud.protocols.server import new_event_loop

    info = {"backend": "ray" if on_ray else "local", "ray_address": ray_address, "host": host}
    try:
        with (
            hold_up_lock(state_dir, info),
            asyncio.Runner(loop_factory=lambda: new_event_loop(GATEWAY_SPIN_ENV)) as runner,
        ):
            runner.run(main())
    except CloudRunningError as exc:
        err.print(f"[red]error:[/] {exc} on the state dir {state_dir}: one cloud per state dir")
        raise typer.Exit(2) from None


def _deploy_once(cloud: Any, model: str, max_replicas: int) -> None:
    """``--deploy MODEL``: create the deployment when it is absent (with ``deploy``'s defaults: octants sized to the
    model, 1 replica, up to ``max_replicas``; held to the same checks); leave an existing one as the operator set
    it."""
    from octacloud.control.deploy_request import DeployRequest
    from octacloud.core.errors import NotFoundError, OctacloudError

    log = logging.getLogger("octacloud.up")
    try:
        existing = cloud.controller.store.get_deployment(model)  # its writes reach SQLite a moment later
    except NotFoundError:
        pass
    else:
        log.info("deployment %s exists (%d replica(s)): left as it is", model, existing.replicas)
        return
    try:
        cloud.controller.apply(DeployRequest({"name": model, "model": model, "tenant": "admin",
                                              "max_replicas": max_replicas}))  # fmt: skip
    except OctacloudError as exc:
        err.print(f"[red]cannot deploy {model}:[/] {exc}")


def _print_fleet_summary(cloud: Any) -> None:
    from octacloud.control.fleet import DEMO_LABEL

    demo = {n.labels.get(DEMO_LABEL) for n in cloud.nodes} - {None}
    title = f"fleet (a demo fleet carved out of {', '.join(sorted(demo))})" if demo else "fleet"
    table = Table(title=title)
    for col in ("node", "cards", "model", "memory MiB/card", "CPU cores"):
        table.add_column(col)
    for n in cloud.nodes:
        card_memory = str(n.gpus[0].memory_mib if n.gpus else 0)
        table.add_row(n.name, str(n.gpu_count), n.gpu_model, card_memory, str(n.cpu_milli // 1000))
    console.print(table)


def _print_sample(cloud: Any, deploy: list[str], base: str, grpc: str, key_file: Path) -> None:
    """The first deployment's sample requests, from the controller's own view of the deployments (what it has
    just created may not be in SQLite yet: its store thread writes a moment later)."""
    names = [*deploy, *(d.spec.name for d in cloud.controller.store.deployments())]
    for name in names:
        try:
            d = cloud.controller.store.get_deployment(name)
        except Exception:  # not deployed after all (refused above)
            continue
        inputs = sample_inputs(cloud.models, d.spec.model)
        if inputs is None:
            continue
        curl, python = sample_requests(base, grpc, name, inputs, key_file)
        console.print(f"ask {name} (REST, then gRPC with tritonclient):", highlight=False)
        console.print(f"  {curl}", soft_wrap=True, highlight=False, markup=False)
        console.print(f"  {python}", soft_wrap=True, highlight=False, markup=False)
        return


def register(app: typer.Typer) -> None:
    app.command()(up)
