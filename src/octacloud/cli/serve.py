"""``octacloud serve``: one replica server (REST, gRPC, metrics) over a Triton-layout model repository."""

from __future__ import annotations

import logging
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    repository: Path = typer.Option(..., "--repository", "--model-repository", help="Model repository folder."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (all three endpoints)."),
    http_port: int = typer.Option(8000, help="REST port (0: pick a free one; -1: off)."),
    grpc_port: int = typer.Option(8001, help="gRPC port (0: pick a free one; -1: off)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port (0: pick a free one; -1: off)."),
    http_fd: int = typer.Option(
        -1, help="Serve REST on this inherited, bound TCP socket instead of --http-port (as a launcher hands it)."
    ),
    grpc_fd: int = typer.Option(-1, help="Serve gRPC on this inherited, bound TCP socket instead of --grpc-port."),
    metrics_fd: int = typer.Option(
        -1, help="Serve metrics on this inherited, bound TCP socket instead of --metrics-port."
    ),
    model_control_mode: str = typer.Option("none", help="none | poll | explicit (Triton's model control modes)."),
    load_model: list[str] = typer.Option([], help="Model to load at start in explicit mode ('*': all)."),
    threads: int = typer.Option(0, help="CPU threads for inference (0: $OCTACLOUD_THREADS or every core)."),
    poll_seconds: float = typer.Option(15.0, help="Repository poll interval in poll mode."),
    max_body_mb: int = typer.Option(64, help="Largest request body (MiB) over REST and gRPC."),
    grpc_server: str = typer.Option("h2", help="h2: octacloud's HTTP/2 gRPC server (leanest); aio: grpc.aio."),
    log_level: str = typer.Option("info", help="Log level."),
) -> None:
    """Serve the models of REPOSITORY over the Open Inference Protocol (REST and gRPC), as Triton does."""
    from octacloud.idlespin import REPLICA_SPIN_ENV, window_us_from_env
    from octacloud.protocols.server import ServerSettings, run
    from octacloud.serving import ControlMode

    try:
        mode = ControlMode(model_control_mode)
    except ValueError:
        raise typer.BadParameter(f"must be none, poll or explicit, got {model_control_mode!r}") from None
    if grpc_server not in ("h2", "aio"):
        raise typer.BadParameter(f"must be h2 or aio, got {grpc_server!r}", param_hint="--grpc-server")
    if not repository.is_dir():
        raise typer.BadParameter(f"{repository} is not a directory", param_hint="--repository")
    try:
        window_us_from_env(REPLICA_SPIN_ENV)
    except ValueError as e:
        typer.echo(f"octacloud serve: {e}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def port(p: int) -> int | None:
        return None if p < 0 else p

    for name, fd in (("--http-fd", http_fd), ("--grpc-fd", grpc_fd), ("--metrics-fd", metrics_fd)):
        if fd >= 0 and fd <= 2:
            raise typer.BadParameter(f"must be a socket's file descriptor (3 or more), got {fd}", param_hint=name)

    settings = ServerSettings(
        repository=repository,
        host=host,
        http_port=port(http_port),
        grpc_port=port(grpc_port),
        metrics_port=port(metrics_port),
        http_fd=port(http_fd),
        grpc_fd=port(grpc_fd),
        metrics_fd=port(metrics_fd),
        control_mode=mode,
        load_models=tuple(load_model),
        threads=threads or None,
        poll_interval_s=poll_seconds,
        max_body_bytes=max_body_mb * 2**20,
        grpc_server=grpc_server,
    )
    try:
        run(settings)
    except OSError as e:  # a port in use, an address that is not ours: say so, no traceback
        typer.echo(f"octacloud serve: {e}", err=True)
        raise typer.Exit(1) from None
