"""The admin REST API: deployments, scaling, fleet and events (what ``octacloud deploy/status/...`` call),
plus tenants, keys and usage (:mod:`octacloud.tenancy.api`).

Every route needs the caller the gateway verified. A tenant sees and changes only its own deployments (others
answer 404, as a missing one does), is held to its quota, gets its priority from the priority classes granted
to it, and reads only the events of its own deployments; the fleet is the admin's. A deployment's model is a
model of the repository, named by its folder (one path component): any other name answers 404 as a missing
model does, so that the answers say nothing about the host's file system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from octacloud.admin.rollouts import rollout_routes
from octacloud.control.controller import Controller
from octacloud.control.deploy_request import DeployRequest
from octacloud.control.deployments import MAX_REPLICAS, Deployment, Replica
from octacloud.control.models import unknown_model
from octacloud.core import fields
from octacloud.core.domains import domain_dict
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.metering import Ledger, PriceSheet
from octacloud.scheduler.framework.state import ClusterState
from octacloud.serving import is_model_name
from octacloud.tenancy import ANONYMOUS_ADMIN, KeyStore, Principal
from octacloud.tenancy.api import (
    EXCEPTION_HANDLERS,
    ForbiddenError,
    json_object,
    query_whole,
    require_principal,
    tenant_routes,
)
from octacloud.tenancy.priority import PriorityClasses

MAX_EVENTS = 10_000
"""The most events one ``GET /admin/events`` returns."""


def deployment_json(d: Deployment, replicas: list[Replica], *, internal: bool = True) -> dict[str, Any]:
    """A deployment and its instances as the API shows them; ``internal`` (admins): with their addresses, ports,
    process ids, launcher handles and environment. A tenant sees its replicas' state, not where and as what
    process they run: it reaches them through the gateway alone."""
    instances = []
    for r in replicas:
        row: dict[str, Any] = {
            "id": r.id,
            "state": r.state.value,
            "node": r.node,
            "gpus": list(r.gpus),
            "milli_per_gpu": r.milli_per_gpu,
            "restarts": r.restarts,
            "message": r.message,
        }
        if internal:
            row.update({"pid": r.pid, "host": r.host, "handle": r.handle, "http_port": r.http_port,
                        "grpc_port": r.grpc_port, "metrics_port": r.metrics_port, "env": r.env})  # fmt: skip
        instances.append(row)
    return {
        "spec": dataclasses.asdict(d.spec),
        "replicas": d.replicas,
        "octants": d.octants,
        "generation": d.generation,
        "created_at": d.created_at,
        "instances": instances,
    }


def build_admin_app(
    controller: Controller,
    keys: KeyStore | None = None,
    ledger: Ledger | None = None,
    prices: PriceSheet | None = None,
    priorities: PriorityClasses | None = None,
) -> Starlette:
    """The admin app. Without ``keys`` (tests of the controller alone) every caller is an admin and a raw
    ``priority`` is taken as given; with ``keys``, priorities come from priority classes (:mod:`.auth.priority`,
    on the keys' database unless ``priorities`` is given)."""
    if keys is not None and priorities is None:
        priorities = PriorityClasses(keys.engine, keys.clock)

    def caller(request: Request) -> Principal:
        return require_principal(request) if keys is not None else ANONYMOUS_ADMIN

    return Starlette(
        routes=[
            *_deployment_routes(controller, caller, priorities),
            *_fleet_routes(controller, caller),
            *rollout_routes(controller, caller),
            *(tenant_routes(keys, ledger, prices, priorities) if keys is not None and priorities is not None else []),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
    )


def _deployment_routes(
    controller: Controller, caller: Callable[[Request], Principal], priorities: PriorityClasses | None
) -> list[Route]:
    """``/admin/deployments``: list, create or update, get, delete, scale (a tenant: its own deployments only)."""

    async def list_deployments(request: Request) -> JSONResponse:
        p = caller(request)
        rows = [
            deployment_json(d, rs, internal=p.is_admin) for d, rs in controller.status() if p.may_manage(d.spec.tenant)
        ]
        return JSONResponse({"deployments": rows})

    async def create_deployment(request: Request) -> JSONResponse:
        """Create or update: the body's fields over the defaults or the deployment's own (``deploy_request``);
        the answer says what a redeploy kept and changed. Checks and quotas are the controller's deploy's."""
        return _deploy(controller, priorities, caller(request), await json_object(request))

    async def get_deployment(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        p = caller(request)
        return JSONResponse(
            deployment_json(_owned(controller, p, name), controller.store.replicas(name), internal=p.is_admin)
        )

    async def scale(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        p = caller(request)
        _owned(controller, p, name)
        body = await json_object(request)
        if set(body) != {"replicas"}:
            raise InvalidSpecError('body must be {"replicas": <integer>}')
        d = controller.scale(name, fields.whole(body["replicas"], "replicas", 0, MAX_REPLICAS))
        return JSONResponse(deployment_json(d, controller.store.replicas(name), internal=p.is_admin))

    async def delete(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        p = caller(request)
        if not _set_aside(controller, p, name):  # (its owner may delete one that is set aside)
            _owned(controller, p, name)
        controller.undeploy(name)
        return JSONResponse({"deleted": name})

    return [
        Route("/admin/deployments", list_deployments, methods=["GET"]),
        Route("/admin/deployments", create_deployment, methods=["POST"]),
        Route("/admin/deployments/{name}", get_deployment, methods=["GET"]),
        Route("/admin/deployments/{name}", delete, methods=["DELETE"]),
        Route("/admin/deployments/{name}/scale", scale, methods=["POST"]),
    ]


def _fleet_routes(controller: Controller, caller: Callable[[Request], Principal]) -> list[Route]:
    """``/admin/fleet`` (admins) and ``/admin/events`` (a tenant: its own deployments' events)."""

    async def fleet(request: Request) -> JSONResponse:
        if not caller(request).is_admin:
            raise ForbiddenError("the fleet is visible to admin keys only")
        return JSONResponse(fleet_json(controller.scheduler.state))

    async def events(request: Request) -> JSONResponse:
        p = caller(request)
        limit = query_whole(request, "limit", 100, 1, MAX_EVENTS)
        return JSONResponse({"events": controller.store.events(limit, tenant=None if p.is_admin else p.tenant)})

    return [Route("/admin/fleet", fleet, methods=["GET"]), Route("/admin/events", events, methods=["GET"])]


def _deploy(
    controller: Controller, priorities: PriorityClasses | None, p: Principal, body: dict[str, Any]
) -> JSONResponse:
    """``p``'s deploy of ``body``: its owner (a redeploy keeps it), its model, its priority from the classes
    granted to the tenant; then the controller's deploy, which checks it and its quota."""
    DeployRequest(body)  # unknown fields, no name: 400 before anything else is asked
    try:
        existing: Deployment | None = controller.store.get_deployment(str(body["name"]))
    except NotFoundError:
        existing = None
    if existing is not None and p.may_manage(existing.spec.tenant):  # a redeploy keeps its owner too
        body.setdefault("tenant", existing.spec.tenant)
    tenant = body.setdefault("tenant", p.tenant)
    if not p.is_admin and tenant != p.tenant:
        raise ForbiddenError("a tenant may only deploy for itself (leave 'tenant' out)")
    model = body.get("model", "")
    if "model" in body and (not isinstance(model, str) or not is_model_name(model)
                            or not controller.has_model(model)):  # fmt: skip
        raise NotFoundError(unknown_model(controller.models, model))
    named = "priority_class" in body or "priority" in body
    if priorities is not None and (existing is None or named or existing.spec.tenant != tenant):
        body["priority_class"], body["priority"] = priorities.resolve(
            p, str(tenant), body.get("priority_class"), body.get("priority")
        )
    done = controller.apply(DeployRequest(body))
    d = done.deployment
    created = deployment_json(d, controller.store.replicas(d.spec.name), internal=p.is_admin)
    created.update({"sizing": done.sizing, "changes": done.changes, "kept": done.kept})
    return JSONResponse(created, status_code=201)


def _set_aside(controller: Controller, p: Principal, name: str) -> bool:
    """Whether ``name`` is a deployment of ``p``'s that the store set aside as unreadable."""
    return any(u.kind == "deployment" and u.key == name and p.may_manage(u.tenant)
               for u in controller.store.unreadable())  # fmt: skip


def _owned(controller: Controller, p: Principal, name: str) -> Deployment:
    """``p``'s deployment ``name``; one of another tenant's answers as a missing one does."""
    try:
        d = controller.store.get_deployment(name)
    except NotFoundError:  # one set aside: its owner is told why and what to do, anyone else "no such"
        if _set_aside(controller, p, name):
            raise
        raise NotFoundError(f"no deployment named {name!r}") from None
    if not p.may_manage(d.spec.tenant):
        raise NotFoundError(f"no deployment named {name!r}")
    return d


def fleet_json(state: ClusterState) -> dict[str, Any]:
    """The fleet as ``GET /admin/fleet`` shows it: each node, its cards and the replicas on each card."""
    nodes = []
    for i, node in enumerate(state.nodes):
        cards = []
        for g in node.gpus:
            holders = [
                {"replica": a.request.name, "milli": a.placement.milli_per_gpu, "owner": a.request.owner}
                for a in state.on_node[i].values()
                if g.index in a.placement.gpus
            ]
            cards.append(
                {
                    "index": g.index,
                    "model": g.model,
                    "memory_mib": g.memory_mib,
                    "health": g.health.value,
                    "free_milli": state.free_gpu[i][g.index],
                    "replicas": holders,
                }
            )
        nodes.append(
            {
                "name": node.name,
                "health": node.health.value,
                "labels": dict(node.labels),
                "domains": domain_dict(node),
                "cards": cards,
            }
        )
    return {
        "nodes": nodes,
        "allocated_milli": state.allocated_gpu_milli,
        "total_milli": state.total_gpu_milli,
    }
