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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import typer
from rich.table import Table

from octacloud.cli import up_options as opt
from octacloud.cli.cloud import as_typed, console, err
from octacloud.cli.up_options import UpOptions, cloud_config
from octacloud.database import private_folder

if TYPE_CHECKING:
    from octacloud.app import CloudConfig
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
    python_bin = shlex.quote(as_typed("python"))
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


def _lit(value: object) -> str:
    """A Python literal in double quotes (so that the command line needs no escaped single quotes)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _numpy_type(datatype: str) -> str:
    return _NUMPY.get(datatype, datatype.lower())


# ---- up ---------------------------------------------------------------------------------------------------


def up(
    repository: Path = opt.REPOSITORY,
    fleet: Path | None = opt.FLEET,
    state_dir: Path = opt.STATE_DIR,
    host: str = opt.HOST,
    http_port: int = opt.HTTP_PORT,
    grpc_port: int = opt.GRPC_PORT,
    policy: str = opt.POLICY,
    interval: float = opt.INTERVAL,
    cpu_nodes: int = opt.CPU_NODES,
    cpu_cards: int = opt.CPU_CARDS,
    deploy: list[str] = opt.DEPLOY,
    deploy_max_replicas: int = opt.DEPLOY_MAX_REPLICAS,
    tls_cert: Path | None = opt.TLS_CERT,
    tls_key: Path | None = opt.TLS_KEY,
    tls_client_ca: Path | None = opt.TLS_CLIENT_CA,
    allow_insecure: bool = opt.ALLOW_INSECURE,
    meter_interval: float = opt.METER_INTERVAL,
    prices: Path | None = opt.PRICES,
    telemetry_interval: float = opt.TELEMETRY_INTERVAL,
    backend: str = opt.BACKEND,
    ray_address: str | None = opt.RAY_ADDRESS,
    model_storage: str | None = opt.MODEL_STORAGE,
    storage_credentials: Path | None = opt.STORAGE_CREDENTIALS,
    model_cache: Path | None = opt.MODEL_CACHE,
    model_cache_size: str | None = opt.MODEL_CACHE_SIZE,
    warm_copies: int = opt.WARM_COPIES,
    limit: list[str] = opt.LIMIT,
    gateway_workers: int = opt.GATEWAY_WORKERS,
    internal_tls: str = opt.INTERNAL_TLS,
    emulate: bool = opt.EMULATE,
    emulated_latency_ms: float = opt.EMULATED_LATENCY_MS,
    emulated_load_ms: float = opt.EMULATED_LOAD_MS,
    emulated_hosts: int = opt.EMULATED_HOSTS,
) -> None:
    """Run the cloud: fleet, controller, replicas on slices, and the OIP gateway (on this machine, or on Ray)."""
    options = UpOptions(**locals())
    _run(options, cloud_config(options))


def _run(o: UpOptions, config: CloudConfig) -> None:
    """Hold the state dir's lock and run the cloud on its event loop until it is asked to stop."""
    from octacloud.idlespin import GATEWAY_SPIN_ENV
    from octacloud.protocols.server import new_event_loop

    info = {"backend": "ray" if o.on_ray else "local", "ray_address": o.ray_address, "host": o.host}
    try:
        with (
            hold_up_lock(o.state_dir, info),
            asyncio.Runner(loop_factory=lambda: new_event_loop(GATEWAY_SPIN_ENV)) as runner,
        ):
            runner.run(_serve(o, config))
    except CloudRunningError as exc:
        err.print(f"[red]error:[/] {exc} on the state dir {o.state_dir}: one cloud per state dir")
        raise typer.Exit(2) from None


async def _serve(o: UpOptions, config: CloudConfig) -> None:
    """Start the cloud, deploy ``--deploy``'s models, print the banner, serve until stopped, and say what stays."""
    from octacloud.app import Cloud, ray_cloud
    from octacloud.cli.down import adopted, left_running
    from octacloud.core.errors import OctacloudError

    configure_logging()
    try:
        cloud = ray_cloud(config) if o.on_ray else Cloud(config)
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    log_events(cloud.store)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, cloud.request_stop)
    before = cloud.controller.store.replicas()  # what the previous `up` left
    await cloud.start()  # (the controller adopts what still runs before start returns)
    _print_fleet_summary(cloud)
    for model in o.deploy:
        _deploy_once(cloud, model, o.deploy_max_replicas)
    _print_banner(cloud, o, "https" if config.tls is not None else "http")
    if found := adopted(before, cloud.controller.store.replicas()):
        console.print(found, soft_wrap=True, highlight=False)
    await cloud.serve_forever()
    console.print(left_running(cloud.controller.store.replicas(), o.state_dir), soft_wrap=True, highlight=False)


def _print_banner(cloud: Any, o: UpOptions, scheme: str) -> None:
    """Where the cloud answers, the admin key (once), and a request to paste."""
    base = f"{scheme}://{o.host}:{cloud.http_port}"
    console.print(
        f"octacloud is up: OIP REST {base}  gRPC {o.host}:{cloud.grpc_port}  dashboard {base}/dashboard/\n"
        "  (Ctrl-C stops the cloud; replicas keep running until `octacloud down`)",
        soft_wrap=True,
        highlight=False,
    )
    if cloud.admin_key is not None:
        console.print(
            f"admin API key (shown once; also in {o.state_dir / 'admin.key'}, mode 0600):\n  {cloud.admin_key}",
            soft_wrap=True,
        )
    _print_sample(cloud, o.deploy, base, f"{o.host}:{cloud.grpc_port}", o.state_dir / "admin.key")


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
