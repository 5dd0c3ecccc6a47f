"""Monitoring wired to a running cloud: the telemetry sampler, the monitor loop, ``/metrics`` and the dashboard.

:class:`CloudMonitoring` is what ``app.py`` builds: it reads the controller lazily (the cloud constructs the
sampler before the controller, because the scheduler's profile takes the sampler as its telemetry source), opens
NVML when the fleet's GPUs are this host's, and serves two ASGI apps for the gateway.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence

from starlette.applications import Starlette

from octacloud.admin.dashboard.app import Authorize, allow_all, build_dashboard_app, build_metrics_app
from octacloud.admin.dashboard.metering import LedgerTotals
from octacloud.admin.dashboard.state import dashboard_state
from octacloud.control.controller import Controller
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core.clock import Clock
from octacloud.core.model import Node
from octacloud.metering import Ledger
from octacloud.observability.dcgm import CardReading, NvmlCards, open_nvml
from octacloud.observability.exporter import CloudCollector, Collector, cloud_registry
from octacloud.observability.failover import FailoverCoverage
from octacloud.observability.monitor import CloudMonitor
from octacloud.observability.nic import HostNetFiles, NicLoad
from octacloud.observability.replicas import ReplicaInfo, ReplicaScraper
from octacloud.observability.telemetry import TelemetrySampler
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework.state import ClusterState
from octacloud.security.internal_auth import REPLICA_HEADER
from octacloud.tenancy import AuthError, Guard

NVIDIA_LABEL = ("octacloud.io/accelerator", "nvidia")
"""The label fleet discovery puts on a node whose cards NVML found."""


def admin_authorizer(guard: Guard) -> Authorize:
    """Allow callers whose API key has the admin role (the dashboard shows every tenant's work)."""

    def authorize(headers: Mapping[str, str]) -> bool:
        try:
            return guard.authorize(headers).is_admin
        except AuthError:
            return False

    return authorize


def replica_infos(controller: Controller) -> list[ReplicaInfo]:
    """Every replica of every deployment, as monitoring sees it."""
    out = []
    for d, replicas in controller.status():
        for r in replicas:
            out.append(
                ReplicaInfo(
                    id=r.id,
                    deployment=d.spec.name,
                    tenant=d.spec.tenant,
                    state=r.state.value,
                    octants=d.octants,
                    node=r.node,
                    gpus=tuple(r.gpus),
                    milli_per_gpu=r.milli_per_gpu,
                    pid=r.pid if r.handle == str(r.pid) else None,  # a local process (Ray actors run elsewhere)
                    host=r.host or "127.0.0.1",
                    http_port=r.http_port,
                    metrics_port=r.metrics_port,
                    restarts=r.restarts,
                    message=r.message,
                )
            )
    return out


def local_nvml_node(nodes: Sequence[Node]) -> str | None:
    """The fleet node whose cards are this host's NVIDIA GPUs, if any."""
    host = socket.gethostname()
    for n in nodes:
        if n.name == host and n.labels.get(NVIDIA_LABEL[0]) == NVIDIA_LABEL[1]:
            return n.name
    return None


class CloudMonitoring:
    """The sampler (a scheduler telemetry source), the monitor loop, and the apps that show them."""

    def __init__(
        self,
        controller: Callable[[], Controller],
        nodes: Sequence[Node],
        workload: TargetWorkload,
        clock: Clock,
        *,
        interval_s: float = 1.0,
        history_points: int = 900,
        replica_headers: dict[str, str] | None = None,
        replica_tls: ssl.SSLContext | None = None,
        on_card_readings: Callable[[list[CardReading]], None] | None = None,
        local_nic: bool = False,
    ) -> None:
        """``local_nic``: every node of the fleet runs on this host, so this host's NIC load is each node's
        ``network_load``."""
        self._controller = controller
        nvml_node = local_nvml_node(nodes)
        nvml = open_nvml() if nvml_node is not None else None
        self.sampler = TelemetrySampler(
            lambda: self._state().nodes,
            lambda: replica_infos(controller()),
            clock,
            nvml=NvmlCards(nvml) if nvml is not None else None,
            nvml_node=nvml_node,
            cpu_card_model=CPU_CARD_MODEL,
            scraper=ReplicaScraper(timeout_s=1.0, headers=replica_headers, tls=replica_tls, naming=REPLICA_HEADER),
            interval_s=interval_s,
            on_readings=on_card_readings,
            nic=NicLoad(HostNetFiles(), clock) if local_nic else None,
        )
        self.monitor = CloudMonitor(
            self._state,
            workload,
            self.sampler,
            lambda: controller().routes.counters,
            clock,
            interval_s=interval_s,
            history_points=history_points,
        )

    def _state(self) -> ClusterState:
        return self._controller().scheduler.state

    def apps(
        self, authorize: Authorize = allow_all, ledger: Ledger | None = None, extra: Sequence[Collector] = ()
    ) -> tuple[Starlette, Starlette]:
        """``(dashboard, metrics)`` ASGI apps for the gateway's ``/dashboard`` and ``/metrics``; with the usage
        ledger, both show metering totals per tenant; ``extra`` collectors are exported on ``/metrics`` too."""
        totals = LedgerTotals(ledger) if ledger is not None else None
        collector = CloudCollector(
            self.monitor, self._controller().scheduling, totals.metrics if totals is not None else None
        )
        dashboard = build_dashboard_app(
            lambda since: dashboard_state(
                self._controller(), self.monitor, since=since, usage=totals.usage if totals is not None else None
            ),
            authorize,
        )
        coverage = FailoverCoverage(lambda: self._controller().scheduler)
        return dashboard, build_metrics_app(cloud_registry(collector, coverage, *extra), authorize)

    async def run(self, stop: asyncio.Event) -> None:
        await self.monitor.run(stop)

    async def close(self) -> None:
        await self.sampler.close()
