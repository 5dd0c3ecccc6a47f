"""Deploy: the one path every deployment takes, whoever asks (the admin API and the CLI through it,
``octacloud up --deploy``, ``rollout undo``).

In order, before anything is stored: the request's fields over the defaults or over the existing deployment
(:mod:`octacloud.control.deploy_request`), each checked by type and range; the name free, or the caller's own;
the model and version found in the repository; the size resolved and checked against what the fleet could ever
place; the tenant's quota (:class:`DeployAdmission`). Then the deployment is stored, a new revision recorded
when what each replica runs changed (it is rolled out replica by replica), and one event says what was asked,
what the redeploy kept and what it changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from octacloud.control.controller.contracts import FootprintSource, Wakeup
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore
from octacloud.control.deploy_request import DeployRequest, compare, resolve, summary
from octacloud.control.deployments import Deployment, DeploymentSpec, ReplicaState
from octacloud.control.models import check_model, unknown_model
from octacloud.control.sizing import FleetCapacity, Sizing, inflight_per_replica, plan_size, reserve_percent
from octacloud.core.clock import Clock
from octacloud.core.errors import ConflictError, NotFoundError
from octacloud.gateway.routing import Owner, RouteTable
from octacloud.serving import is_model_name
from octacloud.storage.store import ModelStore
from octacloud.tenancy import Holding


class DeployAdmission(Protocol):
    """Whether ``tenant`` may hold a deployment of ``new``'s size (its quota: :class:`~octacloud.tenancy.limits.
    TenantQuotas`). ``admit`` raises to refuse, with a message that says what to change, and changes nothing;
    ``others`` are what the tenant's other deployments may hold now."""

    def admit(self, tenant: str, new: Holding, others: list[Holding]) -> None: ...


@dataclass(frozen=True, slots=True)
class Deployed:
    """What a deploy stored, how its size was chosen, and (for a redeploy) what changed and what was kept."""

    deployment: Deployment
    sizing: str
    changes: dict[str, Any]
    """Field → ``[before, after]`` (``replicas`` and the resolved ``octants`` included)."""
    kept: dict[str, Any]
    """What the operator had set that this request left out, as it stays."""


class Deployer:
    """Carries out :meth:`apply`; ``admission`` (None: no quotas) is asked last."""

    def __init__(
        self,
        *,
        store: ControllerStore,
        models: ModelStore,
        footprint: FootprintSource,
        reservations: Reservations,
        routes: RouteTable,
        clock: Clock,
        wakeup: Wakeup,
        admission: DeployAdmission | None = None,
    ) -> None:
        self.store, self.models, self.footprint, self.reservations = store, models, footprint, reservations
        self.routes, self.clock, self.wakeup, self.admission = routes, clock, wakeup, admission

    def apply(self, request: DeployRequest) -> Deployed:
        try:
            old: Deployment | None = self.store.get_deployment(request.name)
        except NotFoundError:
            old = None
        spec = resolve(request, old.spec if old is not None else None)
        owner = old.spec.tenant if old is not None else self._set_aside_owner(spec.name)
        if owner is not None and owner != spec.tenant:
            raise ConflictError(f"deployment name {spec.name!r} is taken; choose another")
        if not is_model_name(spec.model):
            raise NotFoundError(unknown_model(self.models, spec.model))
        check_model(self.models, spec.model, spec.version)
        sizing = self.sizing(spec)
        replicas = sizing.replicas
        if old is not None and spec.target_qps is None:  # an operator's (or the autoscaler's) count stays, in bounds
            replicas = min(max(old.replicas, spec.min_replicas), spec.max_replicas)
        if self.admission is not None:
            others = [Holding(d.spec.name, d.octants, d.spec.max_replicas) for d in self.store.deployments()
                      if d.spec.tenant == spec.tenant and d.spec.name != spec.name]  # fmt: skip
            self.admission.admit(spec.tenant, Holding(spec.name, sizing.octants, spec.max_replicas), others)
        if old is None:
            d = Deployment(spec, replicas, sizing.octants, created_at=self.clock.time())
        else:
            d = Deployment(spec, replicas, sizing.octants, old.created_at, old.generation + 1)
        running = self._running(spec.name)
        self.store.put_deployment(d)
        changes, kept = compare(request, old, d)
        what = f"{spec.model} × {replicas} on {d.octants} octant(s)" + (f": {sizing.reason}" if sizing.reason else "")
        if old is None or old.template() != d.template():  # a new revision: what each replica runs changed
            what += f", revision {self.store.add_revision(d, self.clock.time())}"
            if old is not None:
                model, version, octants = old.template()
                what += (
                    f" (rolling update of {running} replica(s) from {model} {version or 'latest'} "
                    f"on {octants} octant(s))"
                )
        if old is not None:
            what += f"; {summary(changes, kept)}"
        route(self.routes, self.footprint, spec)
        self.store.add_event("deploy", spec.name, what, deployment=spec.name, tenant=spec.tenant)
        self.wakeup.poke()
        return Deployed(d, sizing.reason, changes, kept)

    def _set_aside_owner(self, name: str) -> str | None:
        """The tenant of the stored deployment ``name`` that could not be read (None: there is none, or its record
        names no tenant); deploying that name again replaces it, for that tenant only."""
        for u in self.store.unreadable():
            if u.kind == "deployment" and u.key == name:
                return u.tenant or None
        return None

    def _running(self, name: str) -> int:
        """Replicas of ``name`` that serve or are on their way to (what a rolling update replaces)."""
        return sum(1 for r in self.store.replicas(name) if not r.replaces and r.state is not ReplicaState.STOPPING)

    def sizing(self, spec: DeploymentSpec) -> Sizing:
        """The size ``spec`` resolves to and why; raises when it could never be placed on this fleet."""
        return plan_size(spec, lambda: self.footprint(spec.model), self.capacity(spec.priority))

    def capacity(self, priority: int = 0) -> FleetCapacity:
        """What the fleet could ever give a deployment of ``priority`` (the failover reserve kept from it)."""
        return FleetCapacity.of(self.reservations.nodes, reserve_percent(self.reservations.scheduler.profile, priority))


def route(routes: RouteTable, footprint: FootprintSource, spec: DeploymentSpec) -> None:
    """Tell the gateway's routes whose ``spec`` is, and a generative deployment's in-flight bound per replica
    (``sizing.inflight_per_replica``: a generation holds an engine slot for seconds)."""
    routes.owners[spec.name] = Owner(spec.tenant, spec.published)
    bound = inflight_per_replica(lambda: footprint(spec.model))
    routes.inflight_per_replica.pop(spec.name, None)
    if bound is not None:
        routes.inflight_per_replica[spec.name] = bound
