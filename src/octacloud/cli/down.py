"""``octacloud down`` (stop the replicas a stopped ``up`` left running), and what ``up`` says about them.

Stopping ``up`` (Ctrl-C) leaves its replicas running; the next ``up`` on the same state dir adopts them, and
``down`` stops them. ``up`` says so when it stops (:func:`left_running`) and what it adopted when it starts
(:func:`adopted`). A replica ``down`` stopped is recorded as stopped on purpose, on its slice: the next ``up``
starts it there again, as a planned start, not as the restart of a failed replica.
"""

from __future__ import annotations

import collections
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from octacloud.cli.cloud import as_typed, console, err
from octacloud.cli.up import up_record

if TYPE_CHECKING:
    from octacloud.control.deployments import Replica

STOPPED_BY_DOWN = "stopped by `octacloud down`: starts again on its slice with the next `octacloud up`"
"""The message of a replica ``down`` stopped (the next ``up`` starts it without counting a restart)."""


def down(
    state_dir: Path = typer.Option(Path("var"), "--state-dir", help="The state dir `octacloud up` used."),
    grace: float = typer.Option(5.0, "--grace", help="Seconds a replica gets to finish before it is killed."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="The Ray cluster of Ray replicas (default: the one `up` recorded, else auto)."
    ),
) -> None:
    """Stop the replicas a stopped `octacloud up` left running (local processes and Ray actors).

    Deployments stay: the next `up` starts the replicas again on their slices (a planned start, not a failure
    restart). Refused while `up` runs on the state dir: stop it first (Ctrl-C), or use `undeploy` / `scale` to
    stop replicas of a running cloud.
    """
    from octacloud.control.store import StateStore

    db = state_dir / "octacloud.db"
    if not db.exists():
        err.print(f"[red]error:[/] no octacloud state in {state_dir} (give the --state-dir `octacloud up` used)")
        raise typer.Exit(2)
    running, record = up_record(state_dir)
    if running:
        err.print(
            f"[red]error:[/] octacloud up (PID {record.get('pid', '?')}) is running on {state_dir}: stop it first "
            "(Ctrl-C in its terminal, or kill -TERM that PID), then run `octacloud down`; to stop replicas of the "
            "running cloud use `octacloud undeploy` or `octacloud scale`"
        )
        raise typer.Exit(1)
    store = StateStore.at(db)
    try:
        replicas = [r for r in store.replicas() if r.handle]
        stopped = _stop(replicas, state_dir, grace, ray_address or record.get("ray_address"))
        for r in replicas:
            if r.handle in stopped:
                store.put_replica(stopped_by_down(r))
    finally:
        store.close()
    console.print(f"stopped {len(stopped)} replica(s) of {state_dir}")


def stopped_by_down(r: Replica) -> Replica:
    """``r`` as ``down`` leaves it: no process, still on its slice, waiting to start there (PENDING and placed:
    the next ``up`` re-accounts the slice and launches it, without counting a restart)."""
    from octacloud.control.deployments import ReplicaState

    r.state, r.handle, r.pid = ReplicaState.PENDING, "", None
    r.host, r.http_port, r.grpc_port, r.metrics_port = "", None, None, None
    r.message, r.after = STOPPED_BY_DOWN, []
    return r


def _stop(replicas: list[Replica], state_dir: Path, grace: float, ray_address: str | None) -> set[str]:
    """Stop what still runs of ``replicas`` (local processes, emulated replicas, Ray actors); their handles."""
    from octacloud.control.emulated import EmulatedLauncher, is_emulated
    from octacloud.control.launcher import LocalProcessLauncher

    handles = [r.handle for r in replicas]
    stopped: set[str] = set()
    local = LocalProcessLauncher(state_dir / "replicas")
    for handle in (h for h in handles if h.isdigit()):
        if local.alive(handle):
            local.stop(handle, grace)
            stopped.add(handle)
    emulated = [h for h in handles if is_emulated(h)]
    if emulated:
        hosts = EmulatedLauncher(state_dir / "replicas")
        for handle in emulated:
            if hosts.alive(handle):
                hosts.stop(handle, grace)
                stopped.add(handle)
        hosts.stop_hosts()
    actors = [h for h in handles if not h.isdigit() and not is_emulated(h)]
    if actors:
        stopped |= _stop_ray_replicas(actors, ray_address, state_dir, grace)
    return stopped


def _stop_ray_replicas(handles: list[str], address: str | None, state_dir: Path, grace: float) -> set[str]:
    """Stop the Ray replica actors named ``handles`` that still exist; their handles."""
    from octacloud.control.ray.backend import RayFleet, RayLauncher, connect
    from octacloud.core.errors import OctacloudError
    from octacloud.storage.store import FsspecStore

    try:
        connect(address)
    except OctacloudError as exc:
        err.print(f"[red]error:[/] {len(handles)} replica(s) ran on Ray, which is out of reach: {exc}")
        raise typer.Exit(1) from None
    launcher = RayLauncher(RayFleet(), FsspecStore(str(state_dir)), state_dir / "model-cache")  # stops only
    stopped: set[str] = set()
    for handle in handles:
        if launcher.alive(handle):
            launcher.stop(handle, grace)
            stopped.add(handle)
    return stopped


# ---- what `up` says about the replicas it leaves and finds --------------------------------------------------


def _per_deployment(replicas: Iterable[Replica]) -> str:
    counts = collections.Counter(r.deployment for r in replicas)
    return ", ".join(f"{name} × {n}" for name, n in sorted(counts.items()))


def left_running(replicas: list[Replica], state_dir: Path) -> str:
    """What ``up`` says when it stops: which replicas keep running, and how to adopt or stop them."""
    running = [r for r in replicas if r.handle]
    if not running:
        return "octacloud stopped; no replica keeps running"
    command = shlex.quote(as_typed("octacloud"))
    return (
        f"octacloud stopped; {len(running)} replica(s) keep running ({_per_deployment(running)}): "
        f"`{command} up --state-dir {state_dir}` adopts them, `{command} down --state-dir {state_dir}` stops them"
    )


def adopted(before: list[Replica], now: list[Replica]) -> str:
    """What ``up`` says once it started: of the replicas stored when it started (``before``), those it found
    running and adopted, those that had stopped meanwhile (restarted as failures), and those ``down`` stopped."""
    handles = {r.id: r.handle for r in before if r.handle}
    kept = [r for r in now if r.handle and handles.get(r.id) == r.handle]
    lost = [r for r in now if r.id in handles and r.handle != handles[r.id]]
    planned = [r for r in before if r.message == STOPPED_BY_DOWN]
    parts = []
    if kept:
        parts.append(f"adopted {len(kept)} running replica(s) ({_per_deployment(kept)})")
    if lost:
        parts.append(f"{len(lost)} had stopped since and start again ({_per_deployment(lost)})")
    if planned:
        parts.append(f"{len(planned)} stopped by `octacloud down` start again ({_per_deployment(planned)})")
    return "; ".join(parts)


def register(app: typer.Typer) -> None:
    app.command()(down)
