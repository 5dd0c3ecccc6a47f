"""A replica as a Ray actor: the model's OIP server (REST, gRPC, metrics) runs inside the actor's process.

The actor is only a vessel. :meth:`ReplicaActor.start` fetches the model into the node's cache, starts a
:class:`~octacloud.protocols.server.ReplicaServer` on its own event loop in a thread of the actor, and
returns where it listens; the gateway then calls that server directly over HTTP or gRPC (faster than a call
through an actor handle). The actor's environment — ``CUDA_VISIBLE_DEVICES``, the MPS limits, the thread
budget — comes from Ray's ``runtime_env`` and is the same slice environment a local replica gets.

Liveness: :meth:`ReplicaActor.watch` blocks until the replica stops, so the owner learns of the actor's death
(its process killed, its node lost) from the call failing, without polling. The actor is threaded
(``max_concurrency``) so that ``watch`` never blocks ``stop`` or ``environment``.

The launcher wraps :class:`ReplicaActor` with ``ray.remote``; only :meth:`ReplicaActor.placement` imports
Ray, inside the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from octacloud.control.launcher import LaunchSpec, model_view
from octacloud.control.models import fetch_model
from octacloud.security import internal_auth
from octacloud.security.internal_tls import Credentials
from octacloud.storage.cache import NodeCache
from octacloud.storage.stats import FetchResult
from octacloud.storage.store import ModelStore

if TYPE_CHECKING:
    from octacloud.protocols.server import ReplicaServer, ServerSettings


@dataclass(frozen=True, slots=True)
class ActorLaunch:
    """What the launcher sends a replica actor to start."""

    spec: LaunchSpec
    node: str
    """The octacloud node the actor runs on (names its model cache)."""
    storage: ModelStore
    """The model store (a folder every node mounts, or an object store's URL with its credentials)."""
    cache_root: Path
    """Where nodes keep their model caches (``<cache_root>/<node>``) and replicas their scratch folders."""
    host: str
    """The address the replica's endpoints bind (the node's address in the Ray cluster)."""
    internal_secret: str | None = None
    """The cloud's internal secret: written (mode 0600) to the replica's scratch folder, whose path the replica
    reads from ``OCTACLOUD_INTERNAL_SECRET_FILE`` as a local replica does (see ``cluster.internal_auth``)."""
    tls: Credentials | None = None
    """Internal TLS: this replica's certificate, key and the cloud CA, written (key mode 0600) to the replica's
    scratch folder; the replica then serves TLS only (see ``cluster.internal_tls``)."""
    cache_limit: int | None = None
    """The node cache's size limit in bytes (``--model-cache-size``; None: no limit)."""


@dataclass(frozen=True, slots=True)
class ActorStarted:
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    pid: int
    cache: FetchResult


class ReplicaActor:
    """One replica: started once by :meth:`start`, serving until :meth:`stop` or the process dies."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_serving: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started: ActorStarted | None = None
        self._scratch: Path | None = None
        self._lease: tuple[NodeCache, str] | None = None

    def start(self, launch: ActorLaunch) -> ActorStarted:
        """Fetch the model, start the server, return once it serves (model loaded and warmed up)."""
        from octacloud.protocols.server import ReplicaServer

        spec = launch.spec
        node_cache = NodeCache(launch.cache_root / launch.node, launch.cache_limit)
        cache = fetch_model(node_cache, launch.storage, spec.model_dir.name, spec.version, lease=spec.replica_id)
        self._lease = (node_cache, spec.replica_id)  # released at stop; a killed actor's lease dies with it
        scratch = launch.cache_root / launch.node / ".replicas" / spec.replica_id
        scratch.mkdir(parents=True, exist_ok=True)
        self._scratch = scratch
        if launch.internal_secret is not None:
            _write_secret(scratch, launch.internal_secret)
        server = ReplicaServer(_server_settings(launch, cache, scratch))
        self._serve(server, spec.replica_id)
        gc.collect()
        gc.freeze()  # as `octacloud serve` does: keep the start-up heap out of the collector (latency tail)
        gc.set_threshold(50_000, 20, 100)
        assert server.http_port is not None and server.grpc_port is not None and server.metrics_port is not None
        ports = (server.http_port, server.grpc_port, server.metrics_port)
        self._started = ActorStarted(launch.host, *ports, os.getpid(), cache)
        return self._started

    def _serve(self, server: ReplicaServer, replica_id: str) -> None:
        """Run ``server`` on its own event loop in a thread of this actor, until :meth:`stop`; return once it
        has started (or raise why it did not)."""
        from octacloud.idlespin import REPLICA_SPIN_ENV
        from octacloud.protocols.server import new_event_loop

        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = new_event_loop(REPLICA_SPIN_ENV)
            self._loop = loop
            self._stop_serving = asyncio.Event()
            try:
                try:
                    loop.run_until_complete(server.start())
                except BaseException as exc:
                    failure.append(exc)
                    return
                finally:
                    started.set()
                loop.run_until_complete(self._stop_serving.wait())
                loop.run_until_complete(server.stop())
            finally:
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=serve, name=f"replica-{replica_id}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    def renew_tls(self, credentials: Credentials) -> None:
        """Replace this replica's certificate files; the server loads them for its next handshakes."""
        if self._scratch is not None:
            credentials.write(self._scratch, "replica")

    def started(self) -> ActorStarted | None:
        """What :meth:`start` returned, or None while it runs (for a controller that adopts this replica)."""
        return self._started

    def placement(self) -> dict[str, Any]:
        """Where this actor runs, as Ray sees it from inside: node id, the resources it holds, its environment."""
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "resources": dict(context.get_assigned_resources()),  # type: ignore[no-untyped-call]
            "env": dict(os.environ),
            "pid": os.getpid(),
        }

    def watch(self) -> None:
        """Return when the replica has stopped; fail (in the caller) when the actor dies first."""
        self._stopped.wait()

    def stop(self, grace: float) -> None:
        """Stop serving: finish requests in flight for up to ``grace`` seconds, unload the model."""
        loop, event, thread = self._loop, self._stop_serving, self._thread
        if loop is None or event is None or thread is None:
            self._stopped.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: already stopped
            loop.call_soon_threadsafe(event.set)
        thread.join(timeout=max(grace, 0.0) + 5.0)
        if self._lease is not None and not thread.is_alive():
            self._lease[0].release(self._lease[1])


def _write_secret(scratch: Path, secret: str) -> None:
    """Write the cloud's internal secret (mode 0600) where this actor's replica reads it, as a local one does."""
    secret_file = scratch / internal_auth.FILE_NAME
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.environ[internal_auth.ENV_VAR] = str(secret_file)  # this actor's own process only


def _server_settings(launch: ActorLaunch, cache: FetchResult, scratch: Path) -> ServerSettings:
    """The replica server's settings: the fetched model's view in ``scratch``, ports the system picks."""
    from octacloud.protocols.server import ServerSettings
    from octacloud.serving import ControlMode

    spec = launch.spec
    local = LaunchSpec(spec.replica_id, spec.serve_as, cache.path, spec.version, spec.env, spec.threads)
    repository = model_view(local, scratch, cache.versions)
    tls = launch.tls.write(scratch, "replica") if launch.tls is not None else None
    return ServerSettings(
        repository=repository,
        host=launch.host,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        control_mode=ControlMode.EXPLICIT,
        load_models=(spec.serve_as,),
        threads=spec.threads,
        tls=tls,
        replica_id=spec.replica_id,
        fetch_seconds=cache.seconds,
    )
