"""The Ray placement backend: octacloud's scheduler decides, Ray runs.

Every server runs a Ray node that advertises its cards as octant resources (``octacloud node start``, see
:mod:`octacloud.control.ray.inventory`). The cloud then:

* builds its fleet from Ray's node table (:class:`RayFleet`) and watches it: a node that joins is added to
  the scheduler's fleet at once, a node that dies is marked FAILED so that its replicas are re-placed on the
  survivors by our scheduler (Ray never re-places an actor pinned to a node), a node that comes back is
  usable again;
* runs each replica as a detached, named Ray actor (:class:`RayLauncher`) pinned with hard node affinity to
  the node the scheduler chose, holding exactly its card's octant resources (so Ray double-checks the
  accounting), with the slice environment in its ``runtime_env``. The actor serves OIP itself; the gateway
  calls it directly: over TLS with the cloud's internal CA when ``internal_ca`` is given (``octacloud up``'s
  default on Ray), each replica's certificate and key handed over in the actor's start arguments. A replica on
  the gateway's own node binds loopback; one on another node binds that node's address in the Ray cluster.

What this protects is the gateway → replica hop (inference data, the internal secret). Ray's own channels
(the actor's start arguments — a replica's key among them —, object transfers, the GCS) are Ray's: in a
cluster of several machines run Ray with its TLS (``RAY_USE_TLS=1``, ``RAY_TLS_SERVER_CERT``,
``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT`` on every node) and keep its ports on a private network.

Only modules under ``control/ray/`` import Ray (an import-linter contract keeps it so).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray
from octacloud.control.controller import NodeChange
from octacloud.control.launcher import Launched, LaunchFailedError, LaunchSpec, ReplicaAddress
from octacloud.control.models import CacheIndex
from octacloud.control.ray.inventory import FAST_FAILURE_DETECTION, node_from_ray, node_name, slice_resources
from octacloud.control.ray.replica import ActorLaunch, ActorStarted, ReplicaActor
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Health, Node
from octacloud.idlespin import REPLICA_SPIN_ENV
from octacloud.security.internal_auth import REPLICA_ID_ENV
from octacloud.security.internal_tls import InternalCa, Renewals
from octacloud.storage.stats import FetchResult, FleetCacheStats
from octacloud.storage.store import ModelStore

log = logging.getLogger("octacloud.ray")

NAMESPACE = "octacloud"
"""The Ray namespace of octacloud's actors (replicas are named, detached actors in it)."""
FORWARDED_ENV = (REPLICA_SPIN_ENV,)
"""Variables of the cloud's environment that its replicas on Ray get too (local replicas inherit the whole
environment; an actor gets only what its ``runtime_env`` names)."""


def forwarded_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


__all__ = ["FAST_FAILURE_DETECTION", "NAMESPACE", "QUIET_ENVIRONMENT", "RayFleet", "RayLauncher", "connect"]

QUIET_ENVIRONMENT = {"RAY_USAGE_STATS_ENABLED": "0"}
"""Set before Ray starts: nothing leaves the machine."""


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one this machine runs) as a driver, once per process."""
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        raise InvalidSpecError(
            f"cannot reach a Ray cluster at {address or 'auto'}: {exc} (start one with `octacloud node start --head`)"
        ) from None


class RayFleet:
    """octacloud's nodes as Ray's node table shows them, and what changed since the last look.

    ``table`` returns ``ray.nodes()``-shaped entries (injected in tests). A node name may have several
    entries — a raylet that died and one that replaced it — and counts as alive when any of them is.
    """

    def __init__(self, table: Callable[[], list[dict[str, Any]]] = ray.nodes) -> None:
        self._table = table
        self._lock = threading.Lock()
        self._known: dict[str, Node] = {}
        self._alive: dict[str, dict[str, Any]] = {}

    def discover(self) -> list[Node]:
        """The live octacloud nodes now, in name order (the fleet to start with)."""
        self.poll()
        with self._lock:
            return [self._known[n] for n in sorted(self._alive)]

    def poll(self) -> list[NodeChange]:
        """Read the node table; return the nodes that joined or came back (HEALTHY) and that died (FAILED)."""
        alive: dict[str, dict[str, Any]] = {}
        seen: dict[str, Node] = {}
        for entry in self._table():
            name = node_name(entry)
            if name is None:
                continue
            if entry.get("Alive") or entry.get("alive"):
                alive[name] = entry
                node = node_from_ray(entry)
                if node is not None:
                    seen[name] = node
        changes: list[NodeChange] = []
        with self._lock:
            for name, node in sorted(seen.items()):
                if name not in self._alive:
                    changes.append(NodeChange(node, Health.HEALTHY))
                    self._known.setdefault(name, node)
            for name in sorted(set(self._alive) - set(alive)):
                changes.append(NodeChange(self._known[name], Health.FAILED))
            self._alive = alive
        return changes

    def node_id(self, name: str) -> str | None:
        """The Ray node id of octacloud node ``name`` while it is alive."""
        with self._lock:
            entry = self._alive.get(name)
        return None if entry is None else str(entry["NodeID"])

    def address(self, name: str) -> str | None:
        """The address node ``name`` is reached at (where its replicas listen)."""
        with self._lock:
            entry = self._alive.get(name)
        return None if entry is None else str(entry.get("NodeManagerAddress") or "127.0.0.1")


class RayLauncher:
    """Replicas as detached Ray actors pinned to the scheduler's node and card (a :class:`ReplicaLauncher`).

    Handles are actor names (``replica-<id>-<nonce>``) in the ``octacloud`` namespace, so a restarted
    controller finds the actors an earlier one started. ``storage`` is the model store every node fetches
    from (a folder every node mounts, or an object store); each node caches models under ``cache_root/<node>``
    (at most ``cache_limit`` bytes).
    """

    def __init__(
        self,
        fleet: RayFleet,
        storage: ModelStore,
        cache_root: Path,
        *,
        cache_limit: int | None = None,
        actor_concurrency: int = 4,
        internal_secret: str | None = None,
        internal_ca: InternalCa | None = None,
        gateway_host: str | None = None,
    ) -> None:
        self.internal_ca = internal_ca
        """Internal TLS: each replica gets a fresh server certificate of this CA with its start arguments."""
        self._renewals = Renewals(internal_ca) if internal_ca is not None else None
        self.gateway_host = gateway_host
        """The address of the node the gateway runs on (default: this process's node, asked of Ray): replicas
        placed there bind loopback, since nothing else needs to reach them."""
        self.internal_secret = internal_secret
        """Handed to every replica actor (see ``ActorLaunch.internal_secret``)."""
        self.fleet = fleet
        self.storage = storage
        self.cache_root = cache_root
        self.cache_limit = cache_limit
        self.cache_stats = FleetCacheStats()
        self.cache_index = CacheIndex()
        self._prefetches: dict[tuple[str, str, str], Any] = {}
        """Which models each node fetched (its replicas and prefetches report it): cache-aware placement."""
        self._actor_class: Any = ray.remote(ReplicaActor)
        self._concurrency = actor_concurrency
        self._actors: dict[str, Any] = {}
        self._starts: dict[str, tuple[str | None, Any]] = {}
        self._watches: dict[str, Any] = {}
        self._addresses: dict[str, ReplicaAddress] = {}

    def launch(self, spec: LaunchSpec) -> Launched:
        s = spec.slice
        if s is None:
            raise InvalidSpecError(f"replica {spec.replica_id}: the Ray launcher needs the slice the scheduler chose")
        node_id, host = self.fleet.node_id(s.node), self.fleet.address(s.node)
        if node_id is None or host is None:
            raise LaunchFailedError(f"node {s.node!r} is not alive in the Ray cluster")
        handle = f"replica-{spec.replica_id}-{uuid.uuid4().hex[:6]}"
        actor = self._actor_class.options(
            name=handle,
            namespace=NAMESPACE,
            lifetime="detached",  # outlives this controller, as local replica processes do
            num_cpus=0,
            num_gpus=0,  # Ray's GPU accounting is not ours: the octant resources below are
            resources=slice_resources(s.gpus, s.milli_per_gpu),
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": {**forwarded_env(), **spec.env, REPLICA_ID_ENV: spec.replica_id}},
            max_concurrency=self._concurrency,
            max_restarts=0,  # a lost replica is re-placed by our scheduler, never restarted in place by Ray
        ).remote()
        host = self.bind_address(host)
        tls = self._renewals.issue(spec.replica_id, [host]) if self._renewals is not None else None
        launch = ActorLaunch(
            spec, s.node, self.storage, self.cache_root, host, self.internal_secret, tls, self.cache_limit
        )
        self._actors[handle] = actor
        self._starts[handle] = (s.node, actor.start.remote(launch))
        self._watches[handle] = actor.watch.remote()
        if self._renewals is not None:
            self._renewals.track(handle, spec.replica_id, [host])
        return Launched(handle, None, None)

    def prefetch(self, node: str, model: str, version: str) -> None:
        """Fetch ``model`` into node ``node``'s cache now, as a Ray task pinned there, ahead of a replica that
        will start on it. Never waits; a prefetch already under way there is not repeated."""
        self._collect_prefetches()
        node_id = self.fleet.node_id(node)
        key = (node, model, version)
        if node_id is None or key in self._prefetches:
            return
        task = ray.remote(_prefetch_on_node).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        )
        self._prefetches[key] = task.remote(self.storage, self.cache_root / node, self.cache_limit, model, version)

    def _collect_prefetches(self) -> None:
        refs = list(self._prefetches.values())
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for key, ref in list(self._prefetches.items()):
            if ref not in done:
                continue
            del self._prefetches[key]
            try:
                result: FetchResult = ray.get(ref)
            except ray.exceptions.RayError as exc:
                log.warning("prefetch of %s on %s failed: %s", key[1], key[0], _first_line(exc))
                continue
            self.cache_stats.record(key[0], result)
            self.cache_index.record(key[0], key[1])

    def bind_address(self, node_address: str) -> str:
        """Where a replica on the node at ``node_address`` listens: loopback on the gateway's node, else that
        node's address (the only one the gateway can reach it at)."""
        if self.gateway_host is None:
            self.gateway_host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        return "127.0.0.1" if node_address == self.gateway_host else node_address

    def address(self, handle: str) -> ReplicaAddress | None:
        known = self._addresses.get(handle)
        if known is not None:
            return known
        if handle not in self._starts:  # started by an earlier controller: ask the actor how far it got
            actor = self._actor(handle)
            if actor is None:
                raise LaunchFailedError(f"replica actor {handle} is gone")
            self._starts[handle] = (None, actor.started.remote())
        node, ref = self._starts[handle]
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        del self._starts[handle]
        try:
            started: ActorStarted | None = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise LaunchFailedError(_first_line(exc)) from None
        if started is None:
            return None  # still starting: asked again on the next health check
        note = ""
        if node is not None:  # an adopted replica's cache outcome was recorded by the controller that started it
            self.cache_stats.record(node, started.cache)
            self.cache_index.record(node, started.cache.path.name)
            note = started.cache.describe(node)
        address = ReplicaAddress(
            started.host, started.http_port, started.grpc_port, started.metrics_port, started.pid, note
        )
        self._addresses[handle] = address
        return address

    def alive(self, handle: str) -> bool:
        watch = self._watches.get(handle)
        if watch is None:  # started by an earlier controller: find the actor and watch it from now on
            actor = self._actor(handle)
            if actor is None:
                return False
            watch = self._watches[handle] = actor.watch.remote()
        ready, _ = ray.wait([watch], timeout=0)
        return not ready

    def adopt_certificate(self, handle: str, replica_id: str, host: str) -> None:
        """A replica an earlier controller started: renew its certificate from now on (the next renewal first)."""
        if self._renewals is not None:
            self._renewals.adopt(handle, replica_id, [host])

    def renew_certificates(self) -> int:
        """Send a new certificate to each replica actor whose certificate is past half its life (the replica
        loads it for its next handshakes); returns how many were sent. Never waits for an actor."""
        if self._renewals is None:
            return 0
        renewed = 0
        for handle, _, credentials in self._renewals.due():
            actor = self._actor(handle)
            if actor is not None:
                actor.renew_tls.remote(credentials)
                renewed += 1
        return renewed

    def stop(self, handle: str, grace: float = 5.0) -> None:
        if self._renewals is not None:
            self._renewals.forget(handle)
        actor = self._actor(handle)
        self._starts.pop(handle, None)
        self._watches.pop(handle, None)
        self._addresses.pop(handle, None)
        self._actors.pop(handle, None)
        if actor is None:
            return
        if grace > 0:  # graceful: let requests in flight finish; never wait on a node that is gone
            try:
                ray.get(actor.stop.remote(grace), timeout=grace + 2.0)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        try:
            ray.kill(actor, no_restart=True)  # frees its octant resources on the node
        except ValueError:
            pass

    def placement(self, handle: str) -> dict[str, Any]:
        """Where the actor actually runs, read from inside it: Ray node id, resources Ray gave it, environment."""
        actor = self._actor(handle)
        if actor is None:
            raise LaunchFailedError(f"no replica actor named {handle!r}")
        result: dict[str, Any] = ray.get(actor.placement.remote(), timeout=30)
        return result

    def handles(self) -> None:
        """None: several clouds may share a Ray cluster and its ``octacloud`` namespace, and an actor's name does not
        say whose it is, so a restarted controller must not stop actors its store does not know."""
        return None

    def _actor(self, handle: str) -> Any:
        actor = self._actors.get(handle)
        if actor is not None:
            return actor
        try:
            actor = ray.get_actor(handle, namespace=NAMESPACE)
        except ValueError:  # no such actor (never started, or dead and its name released)
            return None
        self._actors[handle] = actor
        return actor


def _prefetch_on_node(store: ModelStore, root: Path, limit: int | None, model: str, version: str) -> FetchResult:
    """Runs on the node (a Ray task): fill its cache with what a replica of ``model`` needs."""
    from octacloud.control.models import fetch_model
    from octacloud.storage.cache import NodeCache

    return fetch_model(NodeCache(root, limit), store, model, version)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):  # Ray wraps the actor's traceback; its last line says what went wrong
        if not line.startswith(" ") and ("Error" in line or "error" in line):
            return line.strip()[:500]
    return (lines[-1] if lines else type(exc).__name__)[:500]
