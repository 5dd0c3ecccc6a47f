"""The one place where everything is wired: fleet → scheduler → controller → gateway (REST, gRPC, admin).

``Cloud`` runs in one asyncio loop: the controller's reconcile loop, the REST gateway (octacloud's HTTP/1.1
server) with the admin API under ``/admin``, and the gRPC gateway. With ``gateway_workers`` ≥ 1 (``octacloud up``'s
default) the public ports are served by that many worker processes instead (``gateway.workers``), and this
process keeps the rest. Replicas run as their own processes (local) or actors (Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from octacloud.admin.api import build_admin_app
from octacloud.admin.dashboard.monitoring import CloudMonitoring, admin_authorizer, local_nvml_node
from octacloud.control.controller import Controller, ControllerSettings, NodeChange
from octacloud.control.deployments import ReplicaState
from octacloud.control.emulated import EmulatedLauncher, EmulationSettings
from octacloud.control.fleet import discover_fleet, fleet_tariffs, read_fleet_document
from octacloud.control.launcher import LocalProcessLauncher, ReplicaLauncher, StoreFetch
from octacloud.control.models import CacheIndex
from octacloud.control.mps import MpsDaemon, SharingCollector
from octacloud.control.probes import HttpProber, RepositoryFootprints
from octacloud.control.store import StateStore
from octacloud.control.usage import ClusterUsage
from octacloud.control.warm import keep_warm_copies
from octacloud.core.clock import Clock, SystemClock
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node
from octacloud.database import private_folder
from octacloud.gateway.fronts import Fronts, gateway_fronts
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.latency import RouteLatency, RouteLatencyCollector
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import RouteTable
from octacloud.gateway.sharing import Unlimited
from octacloud.gateway.upstream import UpstreamPool
from octacloud.gateway.workers import GatewayWorkers
from octacloud.metering import Ledger, Meter, PriceSheet
from octacloud.observability.card_health import CardHealthWatch
from octacloud.observability.dcgm import CardReading
from octacloud.observability.node_inputs import NodeInputsCollector
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.policies import PRODUCT_DEFAULT, cloud_profile, slice_prior
from octacloud.scheduler.telemetry import MeasuredNetwork, PricedTelemetry
from octacloud.security import internal_auth
from octacloud.security.internal_tls import RENEW_INTERVAL_S, InternalCa, InternalClientTls, InternalTlsMode
from octacloud.security.tls import TlsConfig, check_exposure
from octacloud.storage.stats import FleetCacheStats, ModelCacheCollector
from octacloud.storage.store import StoreUnavailableError, open_store
from octacloud.tenancy import Guard, KeyStore, TenantQuotas, server_secret

log = logging.getLogger("octacloud")

FleetWatcher = Callable[[], list[NodeChange]]
"""Reports what changed in the fleet since it was last called (may block briefly; runs in a thread)."""


@dataclass(slots=True)
class CloudConfig:
    repository: Path
    state_dir: Path = Path("var")
    fleet_file: Path | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    policy: str = PRODUCT_DEFAULT
    cpu_cards: int = 1
    """Without GPUs or a fleet file: CPU "cards" per node."""
    cpu_nodes: int = 1
    """Without GPUs or a fleet file: 1 = this host as one node; more = a demo fleet of that many nodes."""
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    ray_address: str | None = None
    """Run on the Ray cluster at this address ("auto": the one this machine belongs to) instead of locally."""
    model_storage: str | None = None
    """The model store (a folder, ``s3://bucket/prefix`` or another fsspec URL) the controller reads and replicas
    fetch from into their node's cache; default: ``repository``, served in place by local replicas."""
    storage_credentials: Path | None = None
    """S3 credentials file for ``model_storage`` (default: the AWS SDK's environment, profile, instance role)."""
    model_cache: Path | None = None
    """Where nodes cache models: this host's cache (local replicas), ``<model_cache>/<node>`` on Ray; default:
    ``<state_dir>/model-cache``."""
    model_cache_size: int | None = None
    """Each node cache's size limit in bytes (None: no limit): least recently used, unused versions go first."""
    warm_copies: int = 0
    """Nodes per deployment, beyond those running it, that keep its model cached for the failover reserve (the
    ones with the most free GPU), so that a failover does not wait for a download."""
    telemetry_interval_s: float = 1.0
    """How often GPU/replica telemetry is sampled (the scheduler and the dashboard read the latest)."""
    tls: TlsConfig | None = None
    allow_insecure: bool = False
    """Serve plain text on a non-loopback address (API keys then cross the network in clear)."""
    meter_interval_s: float = 10.0
    prices: Path | None = None
    """Price sheet (YAML) for usage reports' cost column."""
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    """The gateway's bounds: body and message size, header/body/idle time, connections, load shedding."""
    gateway_workers: int = 0
    """Processes serving the public REST and gRPC ports. N ≥ 1 (``up``'s default: 1): N worker processes share them
    and this process keeps the controller, store and meter, which run on when a front crashes or passes
    ``limits.worker_max_rss_mib`` (it is restarted). 0: this process serves them (embedding, tests)."""
    emulation: EmulationSettings | None = None
    """Emulate the replicas (``octacloud up --emulate``): each a real OIP endpoint that answers after a set latency
    with no model compute, many per process (control/emulated.py), so that a fleet of any size runs here."""
    internal_tls: InternalTlsMode = InternalTlsMode.AUTO
    """TLS with the cloud's own CA on the gateway → replica hop: auto = on with the Ray launcher (replicas may be
    on other machines), off for local replicas on loopback (see security/internal_tls.py)."""


class Cloud:
    """octacloud on one machine (or, with the Ray launcher, many)."""

    def __init__(
        self,
        config: CloudConfig,
        *,
        nodes: list[Node] | None = None,
        launcher: ReplicaLauncher | None = None,
        clock: Clock | None = None,
        watcher: FleetWatcher | None = None,
    ) -> None:
        self.config = config
        self.watcher = watcher
        _check(config)
        prices = PriceSheet.load(config.prices) if config.prices is not None else None
        private_folder(config.state_dir)  # keys, secrets, the database: its owner's alone
        clock = clock or SystemClock()
        self.nodes = nodes if nodes is not None else discover_fleet(config.fleet_file, cpu_cards=config.cpu_cards,
                                                                   cpu_nodes=config.cpu_nodes)  # fmt: skip
        self.models = open_store(config.model_storage or config.repository, config.storage_credentials)
        """The model store: configs, versions and sizes are read here, replicas fetch from it."""
        if config.model_storage is not None:
            try:
                self.models.check()
            except StoreUnavailableError as exc:  # cached models still start: say so, and go on
                log.error("%s (replicas whose model is cached on their node still start)", exc)
        self.store = StateStore.at(config.state_dir / "octacloud.db")
        internal = self._secure_hops(launcher)
        self._local_gpu()
        self.monitoring = CloudMonitoring(
            lambda: self.controller, self.nodes, slice_prior(), clock, interval_s=config.telemetry_interval_s,
            replica_headers=internal, replica_tls=self.internal_tls, on_card_readings=self._card_readings,
            local_nic=launcher is None,  # the local launcher's nodes all run on this host: its NIC is theirs
        )  # fmt: skip
        """Telemetry (the scheduler's telemetry source), the cloud's ``/metrics`` and the dashboard."""
        cache_root = self.cache_root if config.model_storage is not None else None
        self.cached_models: CacheIndex = getattr(launcher, "cache_index", None) or CacheIndex(cache_root)
        """Which models each node's cache holds (the ``model-cache`` scoring term reads it)."""
        self.routes = RouteTable()
        self.route_latency = RouteLatency(
            self.routes, nodes=lambda: {a.request.name: a.placement.node for a in self.controller.scheduler.state},
            on_report=lambda deployment, replica, why: self.store.add_event("network", replica, why,
                                                                             deployment=deployment),
        )  # fmt: skip
        """The gateway's measured round trip to every replica: routing's tie-break, the nodes' network latency."""
        self._prober = HttpProber(headers=[(internal_auth.HEADER_BYTES, self.internal_secret.encode())],
                                  on_ready=self._readmit, tls=self.internal_tls)  # fmt: skip
        self.keys = KeyStore(self.store.engine, server_secret(config.state_dir / "server.secret"), clock)
        self.controller = self._controller(self._scheduler(clock), launcher, clock)
        self._started = False
        self._stop = asyncio.Event()
        self._meter_stop = asyncio.Event()  # once the fronts stopped: the last interval has the workers' last pushes
        self._tasks: list[asyncio.Task[None]] = []
        self._fronts: Fronts | None = None
        self.gateway_workers: GatewayWorkers | None = None
        """With ``gateway_workers`` ≥ 1: the worker processes (made at start)."""
        self.guard = Guard(self.keys)
        """``guard.authorize(headers)`` → the caller's Principal, or AuthError: for every front end."""
        self.admin_key = bootstrap_admin_key(self.keys, config.state_dir / "admin.key")
        """The admin key created by this start (None when one existed): the CLI shows it once."""
        self.ledger = Ledger(self.store.engine)
        self.usage = ClusterUsage(self.controller, gpu_use=self.monitoring.sampler.gpu_use,
                                  card_power=self.monitoring.sampler.card_power, replica_headers=internal,
                                  replica_tls=self.internal_tls)  # fmt: skip
        self.meter = Meter(self.ledger, self.usage, clock, config.meter_interval_s)
        self._gateways(prices, clock)
        self.http_port = config.http_port
        self.grpc_port = config.grpc_port

    def _secure_hops(self, launcher: ReplicaLauncher | None) -> dict[str, str]:
        """The internal secret and, when the gateway → replica hop runs over TLS, the internal CA and the client
        context every client of replicas uses; returns the headers that prove a request is this cloud's."""
        secret_file = self.config.state_dir / internal_auth.FILE_NAME
        self.internal_secret = internal_auth.ensure_secret(secret_file)
        """Proves to replicas that a request comes from this cloud (see ``cluster.internal_auth``)."""
        self.internal_ca: InternalCa | None = (
            getattr(launcher, "internal_ca", None) if launcher is not None else internal_ca(self.config, remote=False)
        )
        """The cloud's internal CA when the gateway → replica hop runs over TLS (None: plain text on loopback)."""
        client_tls = InternalClientTls.issue(self.internal_ca) if self.internal_ca else None
        self.internal_tls = client_tls.context() if client_tls is not None else None
        """What every client of replicas (gateway, prober, scrapers) connects with under internal TLS."""
        return {internal_auth.HEADER: self.internal_secret}

    def _local_gpu(self) -> None:
        """This host's GPU node, if it has NVIDIA GPUs: its MPS daemon and the watch on its cards' health."""
        gpu_node = local_nvml_node(self.nodes)
        cards = tuple(g.index for g in _node(self.nodes, gpu_node).gpus) if gpu_node is not None else ()
        self.mps: dict[str, MpsDaemon] = {gpu_node: MpsDaemon(self.config.state_dir, cards=cards)} if gpu_node else {}
        """This host's GPU node's MPS control daemon (none on a host without NVIDIA GPUs)."""
        self.card_health = CardHealthWatch(gpu_node) if gpu_node is not None else None
        """Turns this host's NVML readings (XIDs, ECC, a lost GPU) into card health for the controller."""

    def _scheduler(self, clock: Clock) -> Scheduler:
        """The scheduler over the fleet with the cloud's policy, the node inputs below and the nodes' caches."""
        fleet_file = self.config.fleet_file
        tariffs = fleet_tariffs(read_fleet_document(fleet_file), str(fleet_file)) if fleet_file is not None else {}
        network = MeasuredNetwork(self.monitoring.sampler, self.route_latency.node_latency_us)
        self.node_inputs = PricedTelemetry(network, tariffs, clock.time)
        """The sampler's measurements, the round trip to the gateway, power price and cost: ``octacloud_node_*``."""
        profile = cloud_profile(self.config.policy, telemetry=self.node_inputs, model_cache=self.cached_models)
        return Scheduler(ClusterState(self.nodes), profile)

    def _controller(self, scheduler: Scheduler, launcher: ReplicaLauncher | None, clock: Clock) -> Controller:
        config = self.config
        repository = self.cache_root if config.model_storage is not None else config.repository.resolve()
        return Controller(
            store=self.store, nodes=self.nodes, scheduler=scheduler, launcher=launcher or self._local_launcher(),
            repository=repository, routes=self.routes, clock=clock, prober=self._prober,
            footprint=RepositoryFootprints(self.models), settings=config.controller, models=self.models,
            admission=TenantQuotas(self.keys),  # every deploy is held to its tenant's quota, whoever asks
        )  # fmt: skip

    def _gateways(self, prices: PriceSheet | None, clock: Clock) -> None:
        """The REST gateway (with the admin API, the dashboard and ``/metrics``) and the gRPC gateway."""
        config = self.config
        # behind workers, this process's gateways only serve the admin paths: the workers took the rate budget
        front_guard = self.guard if config.gateway_workers == 0 else Guard(self.keys, Unlimited(clock))
        self.grpc_gateway = GrpcGateway(
            self.routes, ready=self._ready, guard=front_guard, limits=config.limits,
            internal_secret=self.internal_secret,
            replica_ssl=InternalClientTls.issue(self.internal_ca).context() if self.internal_ca else None,
        )  # fmt: skip  # a context of its own: the gRPC hop offers ALPN h2 on it
        admin = build_admin_app(self.controller, self.keys, self.ledger, prices)
        cache_stats = getattr(self.controller.launcher, "cache_stats", None)  # the Ray launcher's node caches
        dashboard, metrics = self.monitoring.apps(
            admin_authorizer(self.guard),
            ledger=self.ledger,
            extra=[
                SharingCollector(self.mps),
                RouteLatencyCollector(self.route_latency),
                NodeInputsCollector(self.node_inputs),
                *([ModelCacheCollector(cache_stats)] if isinstance(cache_stats, FleetCacheStats) else []),
            ],
        )
        self.rest_gateway = RestGateway(
            self.routes, admin=admin, ready=self._ready, guard=front_guard, dashboard=dashboard, metrics=metrics,
            limits=config.limits, internal_secret=self.internal_secret,
            pool=UpstreamPool(tls=self.internal_tls) if self.internal_tls is not None else None,
        )  # fmt: skip

    @property
    def cache_root(self) -> Path:
        return (self.config.model_cache or self.config.state_dir / "model-cache").resolve()

    def _local_launcher(self) -> ReplicaLauncher:
        workdir = private_folder(self.config.state_dir / "replicas")  # their logs and environments
        if self.config.emulation is not None:
            return EmulatedLauncher(
                workdir, self.config.emulation, environment=self._node_environment, internal_ca=self.internal_ca
            )
        c = self.config
        fetch = None if c.model_storage is None else StoreFetch(self.models, self.cache_root, c.model_cache_size,
                                                                c.storage_credentials)  # fmt: skip
        return LocalProcessLauncher(workdir, environment=self._node_environment, internal_ca=self.internal_ca,
                                    fetch=fetch)  # fmt: skip  # replicas bind loopback

    def _node_environment(self) -> dict[str, str]:
        """What every local replica gets from its node: the internal secret's file, and the MPS daemon's folders
        (under time-slicing, none)."""
        env = {internal_auth.ENV_VAR: str((self.config.state_dir / internal_auth.FILE_NAME).resolve())}
        for daemon in self.mps.values():
            env.update(daemon.environment())
        return env

    def _card_readings(self, readings: list[CardReading]) -> None:
        """A card that got worse (observability/card_health.py) is marked so: no new work, or failover."""
        if self.card_health is None:
            return
        for verdict in self.card_health.observe(readings):
            log.error("node %s card %d is %s: %s", verdict.node, verdict.gpu, verdict.health.value, verdict.reason)
            self.controller.mark_card(verdict.node, verdict.gpu, verdict.health, verdict.reason)

    async def _watch_mps(self) -> None:
        """Each health interval: a dead MPS daemon is restarted, and a node whose MPS server died restarts its
        GPU replicas (their CUDA contexts went with it)."""
        interval = self.config.controller.health_interval_s
        while not self._stop.is_set():
            for node, daemon in self.mps.items():
                check = await asyncio.to_thread(daemon.check)
                if check.clients_lost:
                    why = "MPS control daemon restarted" if check.daemon_restarted else "MPS server exited"
                    self.controller.store.add_event("node", node, f"{why}: GPU replicas restart ({daemon.mode.value})")
                    self.controller.restart_gpu_replicas(node, why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def _start_mps(self) -> None:
        """Start (or adopt) each GPU node's MPS daemon before any replica starts; say how cards are shared."""
        for node, daemon in self.mps.items():
            mode = await asyncio.to_thread(daemon.start)
            self.controller.store.add_event("node", node, f"GPU sharing: {mode.value} ({daemon.reason})")
            log.info("node %s shares its GPUs by %s (%s)", node, mode.value, daemon.reason)

    def _readmit(self, replica_id: str) -> None:
        """The controller's probe found a replica ready: its ejection ends here and at every gateway worker."""
        self.routes.readmit(replica_id)
        if self.gateway_workers is not None:
            self.gateway_workers.readmit(replica_id)

    async def _start_gateway(self) -> None:
        config = self.config
        if config.gateway_workers == 0:
            self._fronts = gateway_fronts(self.rest_gateway, self.grpc_gateway, config.limits, config.tls)
            await self._fronts.start(config.host, config.http_port, config.grpc_port)
            self.http_port, self.grpc_port = self._fronts.http_port, self._fronts.grpc_port
            return
        self.gateway_workers = GatewayWorkers(
            config.gateway_workers, routes=self.routes, keys=self.keys, admin_app=self.rest_gateway,
            secret=self.internal_secret, state_dir=config.state_dir, store_url=self.store.url, host=config.host,
            limits=config.limits, tls=config.tls, ready=self._ready,
            on_event=lambda message: self.controller.store.add_event("gateway", "workers", message),
            internal_ca=self.internal_ca,
        )  # fmt: skip
        self.http_port, self.grpc_port = await self.gateway_workers.start(config.http_port, config.grpc_port)

    async def start(self) -> None:
        await self._start_mps()
        await self._start_gateway()
        self._tasks.append(asyncio.create_task(self.controller.run(self._stop)))
        await asyncio.sleep(0)  # the controller's loop starts (readiness reports it from now on)
        self._tasks.append(asyncio.create_task(self.monitoring.run(self._stop)))
        if self.watcher is not None:
            self._tasks.append(asyncio.create_task(self._watch_fleet(self.watcher)))
        self._tasks.append(asyncio.create_task(self.meter.run(self._meter_stop)))
        self._tasks.append(asyncio.create_task(self.route_latency.run(self._stop)))
        renew = getattr(self.controller.launcher, "renew_certificates", None)
        if self.internal_ca is not None and renew is not None:
            self._tasks.append(asyncio.create_task(self._renew_certificates(renew)))
        if self.mps:
            self._tasks.append(asyncio.create_task(self._watch_mps()))
        if self.config.warm_copies > 0:
            warm = keep_warm_copies(self.controller, self.config.warm_copies, self._stop)
            self._tasks.append(asyncio.create_task(warm))
        self._started = True
        scheme = "https" if self.config.tls is not None else "http"
        log.info("octacloud gateway on %s://%s:%d (gRPC %d)", scheme, self.config.host, self.http_port, self.grpc_port)

    async def stop(self, stop_replicas: bool = False) -> None:
        """Stop the gateway and controller. Replicas keep running unless ``stop_replicas`` (they are adopted
        by the next start); ``octacloud down`` stops them."""
        self._started = False
        self._stop.set()
        self.controller.poke()
        if stop_replicas:  # all at once, in threads: each may take its grace period
            grace = self.config.controller.stop_grace_s
            stop = self.controller.launcher.stop
            handles = [r.handle for r in self.controller.store.replicas() if r.handle]
            await asyncio.gather(*(asyncio.to_thread(stop, handle, grace) for handle in handles))
        if self._fronts is not None:
            await self._fronts.stop(grace=1.0)
        if self.gateway_workers is not None:
            await self.gateway_workers.stop(grace=1.0)
        self._meter_stop.set()
        await self.grpc_gateway.close()
        for task in self._tasks:  # one still busy after 10 s (a meter's scrape of a fleet) is cancelled
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 10)
        await self._prober.close()
        await self.usage.close()
        await self.monitoring.close()
        if stop_replicas:  # replicas that keep running keep their MPS daemon (the next start adopts both)
            for daemon in self.mps.values():
                await asyncio.to_thread(daemon.stop)
        await asyncio.to_thread(self.controller.store.close)  # what is still queued is stored, then its thread ends
        self.store.close()

    async def serve_forever(self) -> None:
        """Start (unless :meth:`start` already ran) and serve until :meth:`request_stop`; then stop."""
        if not self._started:
            await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def _renew_certificates(self, renew: Callable[[], int]) -> None:
        """Internal TLS: replicas' certificates past half their life are renewed while they run; those an earlier
        run started, whose age is unknown, at the first pass (at start)."""
        adopt: Callable[[str, str, str], None] = getattr(self.controller.launcher, "adopt_certificate", _no_op)
        while not self._stop.is_set():
            try:
                replicas = self.controller.store.replicas()
                ready = [r for r in replicas if r.state is ReplicaState.READY and r.handle and r.host]
                for r in ready:
                    adopt(r.handle, r.id, r.host)  # a no-op for the replicas this run launched
                if renewed := renew():
                    log.info("internal TLS: renewed %d replica certificates", renewed)
            except Exception:
                log.exception("internal TLS: renewing replica certificates failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), RENEW_INTERVAL_S)

    def _ready(self) -> bool:
        """Ready: started, and the controller's loop runs and completes iterations."""
        return self._started and self.controller.ready()[0]

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def scheduler(self) -> Scheduler:
        """The controller's scheduler (replaced when a node joins the fleet)."""
        return self.controller.scheduler

    @property
    def state(self) -> ClusterState:
        return self.controller.scheduler.state

    async def _watch_fleet(self, watcher: FleetWatcher) -> None:
        """Apply what the fleet watcher sees (nodes joining, lost, back) until the cloud stops."""
        interval = self.config.controller.health_interval_s
        while not self._stop.is_set():
            try:
                changes = await asyncio.to_thread(watcher)
            except Exception:  # a watcher that fails once must not stop the cloud; it is asked again
                log.exception("fleet watcher failed")
                changes = []
            for change in changes:
                log.info("fleet: node %s is %s", change.node.name, change.health.value)
            self.controller.nodes_changed(changes)  # (those that join, in one rebuild of the scheduler's state)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)


def _check(config: CloudConfig) -> None:
    """Refuse a configuration that cannot be served safely or at all (before anything is opened)."""
    check_exposure(config.host, config.tls, config.allow_insecure)
    if config.gateway_workers < 0:
        raise InvalidSpecError(f"gateway workers must be 0 (this process) or more, got {config.gateway_workers}")
    if config.tls is not None:
        config.tls.check()


def bootstrap_admin_key(keys: KeyStore, path: Path) -> str | None:
    """On first start (or when every admin key was revoked): create an admin key and write it to ``path``
    (mode 0600) for ``make up`` users and tests. Returns the new key, or None when an admin key exists."""
    key = keys.ensure_admin()
    if key is not None:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    return key


def ray_cloud(config: CloudConfig, *, clock: Clock | None = None) -> Cloud:
    """The cloud on the Ray cluster at ``config.ray_address``: its fleet is Ray's node table (nodes started with
    ``octacloud node start``), its replicas Ray actors, and nodes that join or die are seen while it runs."""
    from octacloud.core.extras import require

    require("ray")
    from octacloud.control.ray.backend import RayFleet, RayLauncher, connect

    connect(config.ray_address)
    fleet = RayFleet()
    nodes = fleet.discover()
    if not nodes:
        raise InvalidSpecError(
            f"the Ray cluster at {config.ray_address or 'auto'} has no octacloud nodes: start each server's node "
            "with `octacloud node start`"
        )
    storage = open_store(config.model_storage or config.repository.resolve(), config.storage_credentials)
    cache = config.model_cache or config.state_dir.resolve() / "model-cache"
    secret = internal_auth.ensure_secret(config.state_dir / internal_auth.FILE_NAME)
    launcher = RayLauncher(
        fleet, storage, cache, internal_secret=secret, internal_ca=internal_ca(config, remote=True),
        cache_limit=config.model_cache_size,
    )  # fmt: skip
    return Cloud(config, nodes=nodes, launcher=launcher, clock=clock, watcher=fleet.poll)


def _no_op(*_: object) -> None:
    pass


def internal_ca(config: CloudConfig, remote: bool) -> InternalCa | None:
    """The cloud's internal CA when ``config.internal_tls`` turns TLS on for replicas that may be ``remote``."""
    return InternalCa.ensure(config.state_dir) if config.internal_tls.enabled(remote) else None


def _node(nodes: list[Node], name: str) -> Node:
    return next(n for n in nodes if n.name == name)
