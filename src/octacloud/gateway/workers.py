"""Gateway worker processes: N processes serve the public REST and gRPC ports, the main process keeps the rest.

``octacloud up --gateway-workers N`` (N ≥ 1; 1 by default) starts N processes of
``python -m octacloud.gateway.workers``. Each listens on the gateway's two ports with ``SO_REUSEPORT`` (the
kernel spreads new connections over them), verifies keys itself against the shared state store, and routes with
its own copy of the route table. The main process keeps the controller, the store, the meter and the admin API,
dashboard and ``/metrics`` (reached from any worker through ``gateway.admin_link``), and feeds the workers over
``gateway.feed``. What is shared, and within which bounds, is in ``gateway.sharing`` and docs/gateway.md
("Gateway workers").

:class:`GatewayWorkers` is the main process's side: it reserves the ports, serves the feed and the internal admin
port, starts the workers and restarts one that exits (kill -9 included) or that passes its memory bound
(``GatewayLimits.worker_max_rss_mib``, which it kills), while the others and the controller keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from octacloud.core.clock import SystemClock
from octacloud.core.errors import InvalidSpecError
from octacloud.database import open_engine
from octacloud.gateway.admin_link import AdminProxy, InternalOnly
from octacloud.gateway.feed import FeedClient, FeedHub
from octacloud.gateway.fronts import RestFront, bind_socket, gateway_fronts
from octacloud.gateway.grpc_proxy import GrpcGateway
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.rest import RestGateway
from octacloud.gateway.routing import RouteTable
from octacloud.gateway.sharing import SharedRateLimiter
from octacloud.gateway.upstream import UpstreamPool
from octacloud.protocols.asgi import ASGIApp
from octacloud.security.internal_auth import read_secret
from octacloud.security.internal_tls import FOLDER as INTERNAL_TLS_FOLDER
from octacloud.security.internal_tls import InternalCa, InternalClientTls
from octacloud.security.tls import TlsConfig
from octacloud.tenancy import Guard, KeyStore, server_secret

log = logging.getLogger(__name__)

MIB = 2**20
MEMORY_CHECK_S = 0.1
"""How often the main process reads each worker's resident memory (against ``worker_max_rss_mib``)."""
OOM_SCORE_ADJ = 500
"""A worker's ``oom_score_adj``: the kernel, out of memory, kills a worker (restarted in 0.2 s) before the main
process or a replica."""
RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
"""Waits before restarting a worker that exited, by how many times in a row it exited within a minute."""
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is told (a JSON file, mode 0600, in the state directory)."""

    count: int
    host: str
    http_port: int
    grpc_port: int
    feed: str
    """The feed's Unix socket."""
    admin_port: int
    """The main process's internal port for the admin API, dashboard and ``/metrics`` (on 127.0.0.1)."""
    state_dir: str
    store_url: str
    limits: dict[str, Any]
    tls: list[str | None] | None = None
    """[certfile, keyfile, client_ca] or None."""
    push_s: float = 0.25
    key_cache_s: float = 5.0
    internal_ca_pem: str | None = None
    """With TLS to the replicas: the cloud's internal CA certificate; each worker issues its own client
    certificate from the CA in ``<state_dir>/internal-tls`` (which must be that one)."""

    def gateway_limits(self) -> GatewayLimits:
        return GatewayLimits(**self.limits)

    def tls_config(self) -> TlsConfig | None:
        if self.tls is None:
            return None
        cert, key, ca = self.tls
        assert cert is not None and key is not None
        return TlsConfig(Path(cert), Path(key), Path(ca) if ca else None)


class GatewayWorkers:
    """The main process's side of N gateway workers (see the module's docstring)."""

    def __init__(
        self,
        count: int,
        *,
        routes: RouteTable,
        keys: KeyStore,
        admin_app: ASGIApp,
        secret: str,
        state_dir: Path,
        store_url: str,
        host: str,
        limits: GatewayLimits,
        tls: TlsConfig | None,
        ready: Callable[[], bool],
        on_event: Callable[[str], None] = lambda message: None,
        push_s: float = 0.25,
        internal_ca: InternalCa | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"gateway workers: at least 1, got {count}")
        self.count = count
        self.keys = keys
        self.state_dir = state_dir.resolve()
        self.store_url = store_url
        self.host = host
        self.limits = limits
        self.tls = tls
        self.on_event = on_event
        self.push_s = push_s
        self.internal_ca = internal_ca
        self.hub = FeedHub(routes, secret, self._feed_path(), ready, workers=count)
        self.admin = InternalOnly(admin_app, secret)
        self._admin_front = RestFront(self.admin, limits)
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._reserved: list[Any] = []
        self._stopping = False
        self.restarts = 0
        self.max_rss = limits.worker_max_rss_mib * MIB
        """A worker whose resident memory passes this is killed (and restarted)."""
        self.memory_kills = 0
        self.http_port = 0
        self.grpc_port = 0
        self.admin_port = 0
        """The internal port (127.0.0.1) where the workers reach the admin API, dashboard and /metrics."""
        keys.listeners.append(self.hub.forget)

    def _feed_path(self) -> Path:
        path = self.state_dir / "gateway-feed.sock"
        if len(str(path)) < 100:
            return path
        return Path(tempfile.mkdtemp(prefix="octacloud-")) / "feed.sock"  # a Unix socket path has ~107 bytes

    def readmit(self, replica_id: str) -> None:
        self.hub.readmit(replica_id)

    def pids(self) -> dict[int, int]:
        """Worker index → the pid of its running process."""
        return {i: p.pid for i, p in self._procs.items() if p.returncode is None}

    async def start(self, http_port: int, grpc_port: int) -> tuple[int, int]:
        """Reserve the ports, start the feed, the internal admin port and every worker; returns the public ports
        once every worker serves (raises, having stopped what it started, when one cannot)."""
        http_sock = bind_socket(self.host, http_port, reuse_port=True, reuse_addr=False)
        grpc_sock = bind_socket(self.host, grpc_port, reuse_port=True, reuse_addr=False)
        self._reserved = [http_sock, grpc_sock]
        self.http_port, self.grpc_port = http_sock.getsockname()[1], grpc_sock.getsockname()[1]
        await self.hub.start()
        admin_port = self.admin_port = await self._admin_front.start("127.0.0.1", 0, reuse_port=False)
        spec = WorkerSpec(
            count=self.count,
            host=self.host,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            feed=str(self.hub.path),
            admin_port=admin_port,
            state_dir=str(self.state_dir),
            store_url=self.store_url,
            limits=asdict(self.limits),
            tls=[str(self.tls.certfile), str(self.tls.keyfile), str(self.tls.client_ca) if self.tls.client_ca else None]
            if self.tls is not None
            else None,
            push_s=self.push_s,
            key_cache_s=self.keys.cache_s,
            internal_ca_pem=self.internal_ca.ca_pem.decode() if self.internal_ca is not None else None,
        )
        self._spec_file = self.state_dir / "gateway-workers.json"
        self._spec_file.unlink(missing_ok=True)
        fd = os.open(self._spec_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(spec), f)
        (self.state_dir / "gateway-workers").mkdir(exist_ok=True)
        try:
            for i in range(self.count):
                await self._spawn(i)
            await self._until_serving(set(range(self.count)))
        except BaseException:
            await self.stop()
            raise
        self._watchers = [asyncio.create_task(self._supervise(i)) for i in range(self.count)]
        self._watchers.append(asyncio.create_task(self._watch_memory()))
        return self.http_port, self.grpc_port

    async def _spawn(self, index: int) -> None:
        log_file = self.state_dir / "gateway-workers" / f"worker-{index}.log"
        with open(log_file, "ab") as out:
            self._procs[index] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "octacloud.gateway.workers",
                str(self._spec_file),
                str(index),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )  # in `up`'s session: a session of its own (an autogroup of its own) doubled the latency on one connection

    async def _until_serving(self, indexes: set[int]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not indexes <= self.serving():
            for i in indexes:
                proc = self._procs[i]
                if proc.returncode is not None:
                    raise RuntimeError(
                        f"gateway worker {i} exited with code {proc.returncode} while starting; "
                        f"see {self.state_dir / 'gateway-workers' / f'worker-{i}.log'}"
                    )
            if loop.time() > deadline:
                raise TimeoutError(f"gateway workers {sorted(indexes - self.serving())} did not start serving")
            await asyncio.sleep(0.05)

    def serving(self) -> set[int]:
        """Indexes of the workers whose process runs, is connected and listens."""
        live = {i for i, p in self._procs.items() if p.returncode is None}
        by_pid = {w.pid: w for w in self.hub.workers.values() if w.ports is not None}
        return {i for i in live if self._procs[i].pid in by_pid}

    async def _supervise(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        recent: list[float] = []
        while not self._stopping:
            code = await self._procs[index].wait()
            if self._stopping:
                return
            now = loop.time()
            recent = [t for t in recent if now - t < 60.0] + [now]
            wait = RESTART_BACKOFF_S[min(len(recent), len(RESTART_BACKOFF_S)) - 1]
            why = f"-{-code} (signal)" if code < 0 else str(code)
            log.error("gateway worker %d exited (code %s): restarting in %g s", index, why, wait)
            self.on_event(f"gateway worker {index} exited (code {why}); restarted")
            await asyncio.sleep(wait)
            if self._stopping:
                return
            self.restarts += 1
            await self._spawn(index)

    async def _watch_memory(self) -> None:
        """Kill (SIGKILL) a worker whose resident memory passed ``max_rss``; its ``_supervise`` restarts it. The
        main process reads the figure itself, so a worker whose loop is stuck in an allocation is still seen."""
        while not self._stopping:
            for index, proc in list(self._procs.items()):
                used = resident_bytes(proc.pid) if proc.returncode is None else None
                if used is None or used <= self.max_rss:
                    continue
                self.memory_kills += 1
                message = (
                    f"gateway worker {index} used {used // MIB} MiB of memory, over its bound of "
                    f"{self.max_rss // MIB} MiB (worker_max_rss_mib): killed"
                )
                log.error("%s", message)
                self.on_event(message)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await asyncio.sleep(MEMORY_CHECK_S)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after ``grace`` + 5 s), the feed and the internal port."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        procs = [p for p in self._procs.values() if p.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), grace + 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        await self.hub.stop()
        if self.hub.path.parent != self.state_dir:  # the private folder made for a long state dir's socket
            shutil.rmtree(self.hub.path.parent, ignore_errors=True)
        await self._admin_front.stop(grace)
        for sock in self._reserved:
            sock.close()
        self._reserved = []


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (``/proc/PID/statm``), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ---- the worker process ------------------------------------------------------------------------------------


async def serve_worker(spec: WorkerSpec, index: int) -> None:
    """One worker: connect to the feed, listen on the shared ports, serve until SIGTERM or the feed ends."""
    state_dir = Path(spec.state_dir)
    with contextlib.suppress(OSError):  # raising one's own score needs no privilege
        Path("/proc/self/oom_score_adj").write_text(str(OOM_SCORE_ADJ))
    secret = read_secret(state_dir / "internal.secret")
    clock = SystemClock()
    engine = open_engine(spec.store_url)
    keys = KeyStore(engine, server_secret(state_dir / "server.secret"), clock, cache_s=spec.key_cache_s)
    limiter = SharedRateLimiter(clock, spec.count)
    guard = Guard(keys, limiter)
    limits = spec.gateway_limits()
    pool, channel_tls = _internal_tls(spec)
    routes = RouteTable()
    feed = FeedClient(Path(spec.feed), secret, index, routes, keys.forget, limiter, push_s=spec.push_s)
    proxy = AdminProxy("127.0.0.1", spec.admin_port, secret)
    rest = RestGateway(
        routes,
        admin=proxy,
        ready=feed.ready,
        guard=guard,
        dashboard=proxy,
        metrics=proxy,
        limits=limits,
        internal_secret=secret,
        pool=pool,
        generation_limits=feed.generations,
    )
    grpc_gateway = GrpcGateway(
        routes, ready=feed.ready, guard=guard, limits=limits, internal_secret=secret, replica_ssl=channel_tls
    )
    fronts = gateway_fronts(rest, grpc_gateway, limits, spec.tls_config())
    await feed.connect()
    await fronts.start(spec.host, spec.http_port, spec.grpc_port, reuse_port=True)
    # as a replica does (protocols/server.py): the start-up heap out of the collector's view, fewer collections
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    feed.serving(fronts.http_port, fronts.grpc_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Ctrl-C at `up`'s terminal reaches the whole process group: `up` stops its workers itself (SIGTERM), so that
    # the supervisor does not see them exit first and restart them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fed = asyncio.create_task(feed.run())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({fed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    await fronts.stop(grace=1.0)
    await feed.flush()  # what the last requests counted reaches the meter
    for task in (fed, stopped):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await feed.close()
    await proxy.close()
    engine.dispose()


def _internal_tls(spec: WorkerSpec) -> tuple[UpstreamPool | None, ssl.SSLContext | None]:
    """With TLS to the replicas: this worker's own client certificate, from the cloud's CA."""
    if spec.internal_ca_pem is None:
        return None, None
    ca = InternalCa.load(Path(spec.state_dir) / INTERNAL_TLS_FOLDER)
    if ca.ca_pem.decode() != spec.internal_ca_pem:
        raise InvalidSpecError(f"the internal CA in {spec.state_dir} is not the one the cloud's main process uses")
    client = InternalClientTls.issue(ca)
    return UpstreamPool(tls=client.context()), InternalClientTls.issue(ca).context()  # gRPC's own: ALPN h2 on it


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m octacloud.gateway.workers SPEC_FILE INDEX", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker-{argv[1]} %(levelname)s %(name)s: %(message)s")
    spec = WorkerSpec(**json.loads(Path(argv[0]).read_text()))
    from octacloud.idlespin import GATEWAY_SPIN_ENV
    from octacloud.protocols.server import new_event_loop

    with asyncio.Runner(loop_factory=lambda: new_event_loop(GATEWAY_SPIN_ENV)) as runner:
        runner.run(serve_worker(spec, int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
