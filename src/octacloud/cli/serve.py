"""``octacloud serve``: one replica server (REST, gRPC, metrics) over a Triton-layout model repository."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from octacloud.protocols.server import ServerSettings
    from octacloud.serving import ControlMode


REPOSITORY: Any = typer.Option(..., "--repository", "--model-repository", help="Model repository folder.")
HOST: Any = typer.Option("127.0.0.1", help="Address to bind (all three endpoints).")
HTTP_PORT: Any = typer.Option(8000, help="REST port (0: pick a free one; -1: off).")
GRPC_PORT: Any = typer.Option(8001, help="gRPC port (0: pick a free one; -1: off).")
METRICS_PORT: Any = typer.Option(8002, help="Prometheus metrics port (0: pick a free one; -1: off).")
HTTP_FD: Any = typer.Option(
    -1, help="Serve REST on this inherited, bound TCP socket instead of --http-port (as a launcher hands it)."
)
GRPC_FD: Any = typer.Option(-1, help="Serve gRPC on this inherited, bound TCP socket instead of --grpc-port.")
METRICS_FD: Any = typer.Option(-1, help="Serve metrics on this inherited, bound TCP socket instead of --metrics-port.")
MODEL_CONTROL_MODE: Any = typer.Option("none", help="none | poll | explicit (Triton's model control modes).")
LOAD_MODEL: Any = typer.Option([], help="Model to load at start in explicit mode ('*': all).")
THREADS: Any = typer.Option(0, help="CPU threads for inference (0: $OCTACLOUD_THREADS or every core).")
POLL_SECONDS: Any = typer.Option(15.0, help="Repository poll interval in poll mode.")
MAX_BODY_MB: Any = typer.Option(64, help="Largest request body (MiB) over REST and gRPC.")
GRPC_SERVER: Any = typer.Option("h2", help="h2: octacloud's HTTP/2 gRPC server (leanest); aio: grpc.aio.")
LOG_LEVEL: Any = typer.Option("info", help="Log level.")
MODEL_STORAGE: Any = typer.Option(
    None,
    "--model-storage",
    help="Fetch --fetch-model from this model store (a folder or URL) into the node "
    "cache first; --repository is then the folder where this replica's one-model view is made.",
)
STORAGE_CREDENTIALS: Any = typer.Option(None, help="S3 credentials file for --model-storage.")
MODEL_CACHE: Any = typer.Option(None, help="The node's model cache folder (with --model-storage).")
MODEL_CACHE_SIZE: Any = typer.Option(None, help="The node cache's size limit (e.g. 20GiB).")
FETCH_MODEL: Any = typer.Option(None, help="With --model-storage: the model to fetch and serve.")
FETCH_VERSION: Any = typer.Option("", help="With --fetch-model: its version ('' = the model's policy).")
SERVE_AS: Any = typer.Option(None, help="With --fetch-model: the name clients use (default: the model).")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    repository: Path = REPOSITORY,
    host: str = HOST,
    http_port: int = HTTP_PORT,
    grpc_port: int = GRPC_PORT,
    metrics_port: int = METRICS_PORT,
    http_fd: int = HTTP_FD,
    grpc_fd: int = GRPC_FD,
    metrics_fd: int = METRICS_FD,
    model_control_mode: str = MODEL_CONTROL_MODE,
    load_model: list[str] = LOAD_MODEL,
    threads: int = THREADS,
    poll_seconds: float = POLL_SECONDS,
    max_body_mb: int = MAX_BODY_MB,
    grpc_server: str = GRPC_SERVER,
    log_level: str = LOG_LEVEL,
    model_storage: str | None = MODEL_STORAGE,
    storage_credentials: Path | None = STORAGE_CREDENTIALS,
    model_cache: Path | None = MODEL_CACHE,
    model_cache_size: str | None = MODEL_CACHE_SIZE,
    fetch_model: str | None = FETCH_MODEL,
    fetch_version: str = FETCH_VERSION,
    serve_as: str | None = SERVE_AS,
) -> None:
    """Serve the models of REPOSITORY over the Open Inference Protocol (REST and gRPC), as Triton does."""
    from octacloud.protocols.server import ServerSettings
    from octacloud.serving import ControlMode

    mode = _control_mode(model_control_mode, grpc_server)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fetch_seconds: float | None = None
    if model_storage is not None:
        repository, load_model, fetch_seconds = _fetched(
            model_storage, storage_credentials, model_cache, model_cache_size, fetch_model, fetch_version,
            serve_as, repository,
        )  # fmt: skip
        mode = ControlMode.EXPLICIT
    if not repository.is_dir():
        raise typer.BadParameter(f"{repository} is not a directory", param_hint="--repository")
    _check_endpoints(http_fd, grpc_fd, metrics_fd)
    settings = ServerSettings(
        repository=repository,
        host=host,
        http_port=_port(http_port),
        grpc_port=_port(grpc_port),
        metrics_port=_port(metrics_port),
        http_fd=_port(http_fd),
        grpc_fd=_port(grpc_fd),
        metrics_fd=_port(metrics_fd),
        control_mode=mode,
        load_models=tuple(load_model),
        threads=threads or None,
        poll_interval_s=poll_seconds,
        max_body_bytes=max_body_mb * 2**20,
        grpc_server=grpc_server,
        fetch_seconds=fetch_seconds,
    )
    _run(settings)


def _control_mode(model_control_mode: str, grpc_server: str) -> ControlMode:
    """The model control mode asked for, with the gRPC server's choice checked."""
    from octacloud.serving import ControlMode

    try:
        mode = ControlMode(model_control_mode)
    except ValueError:
        raise typer.BadParameter(f"must be none, poll or explicit, got {model_control_mode!r}") from None
    if grpc_server not in ("h2", "aio"):
        raise typer.BadParameter(f"must be h2 or aio, got {grpc_server!r}", param_hint="--grpc-server")
    return mode


def _run(settings: ServerSettings) -> None:
    """Serve until stopped; a port in use or an address that is not ours is the error, without a traceback."""
    from octacloud.protocols.server import run

    try:
        run(settings)
    except OSError as e:
        typer.echo(f"octacloud serve: {e}", err=True)
        raise typer.Exit(1) from None


def _port(p: int) -> int | None:
    """A port or file descriptor option's value: None when it is off (negative)."""
    return None if p < 0 else p


def _check_endpoints(http_fd: int, grpc_fd: int, metrics_fd: int) -> None:
    """The replica's spin window (from the environment) and the inherited sockets' descriptors, checked."""
    from octacloud.idlespin import REPLICA_SPIN_ENV, window_us_from_env

    try:
        window_us_from_env(REPLICA_SPIN_ENV)
    except ValueError as e:
        typer.echo(f"octacloud serve: {e}", err=True)
        raise typer.Exit(2) from None
    for name, fd in (("--http-fd", http_fd), ("--grpc-fd", grpc_fd), ("--metrics-fd", metrics_fd)):
        if fd >= 0 and fd <= 2:
            raise typer.BadParameter(f"must be a socket's file descriptor (3 or more), got {fd}", param_hint=name)


def _fetched(
    storage: str,
    credentials: Path | None,
    cache_root: Path | None,
    cache_size: str | None,
    model: str | None,
    version: str,
    serve_as: str | None,
    view_root: Path,
) -> tuple[Path, list[str], float]:
    """Fetch ``model`` from the store into the node cache (leased to this process while it runs) and make the
    one-model repository this replica serves; returns it, the model to load, and the fetch's seconds."""
    from octacloud.control.launcher import LaunchSpec, model_view
    from octacloud.control.models import fetch_model
    from octacloud.core.errors import OctacloudError
    from octacloud.protocols.internal import replica_id_from_env
    from octacloud.storage.cache import NodeCache
    from octacloud.storage.sizes import parse_size
    from octacloud.storage.store import open_store

    if model is None or cache_root is None:
        raise typer.BadParameter("--model-storage needs --fetch-model and --model-cache", param_hint="--model-storage")
    name = serve_as or model
    try:
        cache = NodeCache(cache_root, parse_size(cache_size) if cache_size else None)
        lease = replica_id_from_env() or f"serve-{os.getpid()}"
        result = fetch_model(cache, open_store(storage, credentials), model, version, lease=lease)
    except OctacloudError as e:
        typer.echo(f"octacloud serve: {e}", err=True)
        raise typer.Exit(3) from None
    logging.getLogger("octacloud.storage").info("%s", result.describe(os.uname().nodename))
    (view_root.parent / "fetch.json").write_text(json.dumps(result.to_json()))
    spec = LaunchSpec(lease, name, result.path, version, {}, 0)
    return model_view(spec, view_root.parent, result.versions), [name], result.seconds
