"""A controller with no processes: a manual clock, a fake launcher and a fake prober."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from octacloud.control.controller import Controller, ControllerSettings, Probe
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deployments import DeploymentSpec, Replica, ReplicaState
from octacloud.control.launcher import Launched, LaunchFailedError, LaunchSpec, ReplicaAddress
from octacloud.control.sizing import ModelFootprint
from octacloud.control.store import StateStore
from octacloud.core.clock import Clock, ManualClock
from octacloud.core.model import Gpu, Node
from octacloud.gateway.routing import RouteTable
from octacloud.scheduler.framework.runner import Profile, Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.policies import build_profile, cloud_profile


@dataclass
class FakeLauncher:
    """Replicas that exist only as handles; ``fail`` makes launches of these replica ids raise."""

    launched: list[LaunchSpec] = field(default_factory=list)
    running: dict[str, LaunchSpec] = field(default_factory=dict)
    stopped: list[tuple[str, float]] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)
    refuse: set[str] = field(default_factory=set)
    """Deployments whose launches raise from now on."""
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def launch(self, spec: LaunchSpec) -> Launched:
        if spec.replica_id in self.fail or spec.serve_as in self.refuse:
            raise LaunchFailedError("refused by the test")
        handle = f"h{next(self._ids)}"
        self.launched.append(spec)
        self.running[handle] = spec
        port = 9000 + len(self.launched) * 3
        return Launched(handle, ReplicaAddress("127.0.0.1", port, port + 1, port + 2, pid=None))

    def address(self, handle: str) -> ReplicaAddress | None:
        return None

    def alive(self, handle: str) -> bool:
        return handle in self.running

    def stop(self, handle: str, grace: float = 5.0) -> None:
        self.stopped.append((handle, grace))
        self.running.pop(handle, None)

    def handles(self) -> list[str]:
        return list(self.running)

    def crash(self, replica_id: str) -> None:
        for handle, spec in list(self.running.items()):
            if spec.replica_id == replica_id:
                del self.running[handle]

    def ids(self) -> set[str]:
        return {spec.replica_id for spec in self.running.values()}


@dataclass
class FakeProber:
    """Every replica is ready unless told otherwise (``answers`` by replica id)."""

    answers: dict[str, Probe] = field(default_factory=dict)
    default: Probe = field(default_factory=lambda: Probe(True))

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe:
        return self.answers.get(replica.id, self.default)


def fleet(nodes: int = 2, cards: int = 1) -> list[Node]:
    return [Node(f"n{i}", 16_000, 65_536, tuple(Gpu(g, "T4", 16_384) for g in range(cards))) for i in range(nodes)]


class Harness:
    def __init__(
        self,
        tmp: Path,
        nodes: list[Node] | None = None,
        store: StateStore | None = None,
        policy: str = "",
        **settings: float,
    ):
        """``policy``: schedule with the cloud's profile of that name (default: bestfit without the rules)."""
        self.tmp = tmp
        self.policy = policy
        for model in ("m", "m2"):
            for version in ("1", "2"):
                (tmp / "models" / model / version).mkdir(parents=True, exist_ok=True)
        self.nodes = nodes or fleet()
        self.clock = ManualClock()
        self.launcher = FakeLauncher()
        self.prober = FakeProber()
        self.routes = RouteTable()
        self.footprint: Callable[[str], ModelFootprint] = lambda model: ModelFootprint(1 << 20)
        """What the controller reads models' footprints from (a test may make it fail)."""
        self.backing = store or StateStore.at(tmp / "state.db")
        self.wrap: Callable[[StateStore, Clock], ControllerStore] = ControllerStore
        self.controller = self.make()
        for key, value in settings.items():
            setattr(self.controller.settings, key, value)

    @property
    def store(self) -> ControllerStore:
        """What the controller reads and writes (the database holds the same once its writes are stored)."""
        return self.controller.store

    def make(self) -> Controller:
        """A new controller over the same database (the old one's queued writes stored first)."""
        old: Controller | None = getattr(self, "controller", None)
        if old is not None:
            old.store.close()
        return Controller(
            store=self.wrap(self.backing, self.clock),
            nodes=list(self.nodes),
            scheduler=Scheduler(ClusterState(self.nodes), self.profile()),
            launcher=self.launcher,
            repository=self.tmp / "models",
            routes=self.routes,
            clock=self.clock,
            prober=self.prober,
            footprint=lambda model: self.footprint(model),
            settings=ControllerSettings(drain_timeout_s=1.0),
        )

    def profile(self) -> Profile:
        return cloud_profile(self.policy) if self.policy else build_profile("bestfit", seed=0)

    def deploy(self, name: str, octants: int = 4, replicas: int = 1, **spec: object) -> None:
        self.controller.deploy(
            DeploymentSpec(name, str(spec.pop("model", "m")), octants=octants, min_replicas=replicas,
                           max_replicas=replicas, **spec)  # type: ignore[arg-type]
        )  # fmt: skip

    async def settle(self) -> None:
        """Let background drains and stops finish."""
        for _ in range(50):
            pending = self.controller.lifecycle.in_progress()
            if not pending:
                return
            await asyncio.wait(pending, timeout=5)

    async def reconcile(self) -> None:
        await self.controller.reconcile()
        await self.settle()

    async def health(self) -> None:
        await self.controller.check_health()
        await self.settle()

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        return self.store.replicas(deployment)

    def ready(self, deployment: str) -> list[Replica]:
        return [r for r in self.replicas(deployment) if r.state is ReplicaState.READY]

    def routed(self, deployment: str) -> list[str]:
        return [e.replica_id for e in self.routes.routes.get(deployment, [])]

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e for e in self.store.events(1000) if e["kind"] == kind]
