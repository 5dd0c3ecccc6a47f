"""The admin REST API: deployments, scaling, fleet and events (what ``octacloud deploy/status/...`` call),
plus tenants, keys and usage (:mod:`octacloud.cluster.auth.api`).

Every route needs the caller the gateway verified. A tenant sees and changes only its own deployments (others
answer 404, as a missing one does) and is held to its quota; the fleet is the admin's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from octacloud.cluster.auth import ANONYMOUS_ADMIN, Holding, KeyStore, Principal, QuotaExceededError, check_quota
from octacloud.cluster.auth.api import principal_of, tenant_routes, unauthenticated
from octacloud.cluster.controller import Controller
from octacloud.cluster.deployments import Deployment, DeploymentSpec, Replica
from octacloud.cluster.rollout_api import rollout_routes
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.metering import Ledger, PriceSheet

_SPEC_FIELDS = {f.name for f in dataclasses.fields(DeploymentSpec)}


def deployment_json(d: Deployment, replicas: list[Replica]) -> dict[str, Any]:
    return {
        "spec": dataclasses.asdict(d.spec),
        "replicas": d.replicas,
        "octants": d.octants,
        "generation": d.generation,
        "created_at": d.created_at,
        "instances": [
            {
                "id": r.id,
                "state": r.state.value,
                "node": r.node,
                "gpus": list(r.gpus),
                "milli_per_gpu": r.milli_per_gpu,
                "pid": r.pid,
                "host": r.host,
                "handle": r.handle,
                "http_port": r.http_port,
                "grpc_port": r.grpc_port,
                "metrics_port": r.metrics_port,
                "restarts": r.restarts,
                "message": r.message,
                "env": r.env,
            }
            for r in replicas
        ],
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def build_admin_app(
    controller: Controller,
    keys: KeyStore | None = None,
    ledger: Ledger | None = None,
    prices: PriceSheet | None = None,
) -> Starlette:
    """The admin app. Without ``keys`` (tests of the controller alone) every caller is an admin."""

    def caller(request: Request) -> Principal | None:
        return principal_of(request) if keys is not None else ANONYMOUS_ADMIN

    def owned(p: Principal, name: str) -> Deployment:
        d = controller.store.get_deployment(name)
        if not p.may_manage(d.spec.tenant):
            raise NotFoundError(f"no deployment named {name!r}")
        return d

    def admit(p: Principal, spec: DeploymentSpec, octants: int) -> None:
        if keys is None:
            return
        quota = keys.tenant(spec.tenant).quota
        held = [Holding(d.spec.name, d.octants, d.spec.max_replicas)
                for d in controller.store.deployments() if d.spec.tenant == spec.tenant]  # fmt: skip
        check_quota(spec.tenant, quota, held, Holding(spec.name, octants, spec.max_replicas))

    async def list_deployments(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        rows = [deployment_json(d, rs) for d, rs in controller.status() if p.may_manage(d.spec.tenant)]
        return JSONResponse({"deployments": rows})

    async def create_deployment(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        unknown = sorted(set(body) - _SPEC_FIELDS)
        if unknown:
            return _error(400, f"unknown deployment field(s) {unknown}; allowed: {sorted(_SPEC_FIELDS)}")
        tenant = body.setdefault("tenant", p.tenant)
        if not p.is_admin and tenant != p.tenant:
            return _error(403, "a tenant may only deploy for itself (leave 'tenant' out)")
        try:
            spec = DeploymentSpec(**body)
            try:
                existing = controller.store.get_deployment(spec.name)
            except NotFoundError:
                pass
            else:
                if existing.spec.tenant != spec.tenant:
                    return _error(409, f"deployment name {spec.name!r} is taken; choose another")
            if keys is not None:
                admit(p, spec, spec.octants if spec.octants is not None else controller.resolve_size(spec)[0])
            d = controller.deploy(spec)
        except TypeError as exc:
            return _error(400, f"bad deployment: {exc}")
        except QuotaExceededError as exc:
            return _error(403, str(exc))
        except InvalidSpecError as exc:
            return _error(400, str(exc))
        except NotFoundError as exc:
            return _error(404, str(exc))
        created = deployment_json(d, controller.store.replicas(d.spec.name))
        created["sizing"] = controller.sizing(d.spec).reason  # how the size was chosen, for the operator
        return JSONResponse(created, status_code=201)

    async def get_deployment(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        name = request.path_params["name"]
        try:
            d = owned(p, name)
        except NotFoundError as exc:
            return _error(404, str(exc))
        return JSONResponse(deployment_json(d, controller.store.replicas(name)))

    async def scale(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        name = request.path_params["name"]
        try:
            owned(p, name)
        except NotFoundError as exc:
            return _error(404, str(exc))
        try:
            body = await request.json()
            replicas = body["replicas"]
            if not isinstance(replicas, int) or isinstance(replicas, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return _error(400, 'body must be {"replicas": <integer>}')
        try:
            d = controller.scale(name, replicas)
        except NotFoundError as exc:
            return _error(404, str(exc))
        except InvalidSpecError as exc:
            return _error(400, str(exc))
        return JSONResponse(deployment_json(d, controller.store.replicas(name)))

    async def delete(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        name = request.path_params["name"]
        try:
            owned(p, name)
            controller.undeploy(name)
        except NotFoundError as exc:
            return _error(404, str(exc))
        return JSONResponse({"deleted": name})

    async def fleet(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        if not p.is_admin:
            return _error(403, "the fleet is visible to admin keys only")
        state = controller.scheduler.state
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
            nodes.append({"name": node.name, "health": node.health.value, "labels": dict(node.labels), "cards": cards})
        return JSONResponse(
            {
                "nodes": nodes,
                "allocated_milli": state.allocated_gpu_milli,
                "total_milli": state.total_gpu_milli,
            }
        )

    async def events(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        try:
            limit = int(request.query_params.get("limit", "100"))
        except ValueError:
            return _error(400, "limit must be a whole number")
        found = controller.store.events(limit, tenant=None if p.is_admin else p.tenant)
        return JSONResponse({"events": found})

    return Starlette(
        routes=[
            Route("/admin/deployments", list_deployments, methods=["GET"]),
            Route("/admin/deployments", create_deployment, methods=["POST"]),
            Route("/admin/deployments/{name}", get_deployment, methods=["GET"]),
            Route("/admin/deployments/{name}", delete, methods=["DELETE"]),
            Route("/admin/deployments/{name}/scale", scale, methods=["POST"]),
            Route("/admin/fleet", fleet, methods=["GET"]),
            Route("/admin/events", events, methods=["GET"]),
            *rollout_routes(controller, caller),
            *(tenant_routes(keys, ledger, prices) if keys is not None else []),
        ]
    )
