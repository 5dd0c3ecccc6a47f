"""The admin REST API: deployments, scaling, fleet and events (what ``octacloud deploy/status/...`` call)."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from octacloud.cluster.controller import Controller
from octacloud.cluster.deployments import Deployment, DeploymentSpec, Replica
from octacloud.core.errors import InvalidSpecError, NotFoundError

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


def build_admin_app(controller: Controller) -> Starlette:
    async def list_deployments(_: Request) -> JSONResponse:
        return JSONResponse({"deployments": [deployment_json(d, rs) for d, rs in controller.status()]})

    async def create_deployment(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        unknown = sorted(set(body) - _SPEC_FIELDS)
        if unknown:
            return _error(400, f"unknown deployment field(s) {unknown}; allowed: {sorted(_SPEC_FIELDS)}")
        try:
            d = controller.deploy(DeploymentSpec(**body))
        except TypeError as exc:
            return _error(400, f"bad deployment: {exc}")
        except InvalidSpecError as exc:
            return _error(400, str(exc))
        except NotFoundError as exc:
            return _error(404, str(exc))
        return JSONResponse(deployment_json(d, controller.store.replicas(d.spec.name)), status_code=201)

    async def get_deployment(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        try:
            d = controller.store.get_deployment(name)
        except NotFoundError as exc:
            return _error(404, str(exc))
        return JSONResponse(deployment_json(d, controller.store.replicas(name)))

    async def scale(request: Request) -> JSONResponse:
        name = request.path_params["name"]
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
        name = request.path_params["name"]
        try:
            controller.undeploy(name)
        except NotFoundError as exc:
            return _error(404, str(exc))
        return JSONResponse({"deleted": name})

    async def fleet(_: Request) -> JSONResponse:
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
        limit = int(request.query_params.get("limit", "100"))
        return JSONResponse({"events": controller.store.events(limit)})

    return Starlette(
        routes=[
            Route("/admin/deployments", list_deployments, methods=["GET"]),
            Route("/admin/deployments", create_deployment, methods=["POST"]),
            Route("/admin/deployments/{name}", get_deployment, methods=["GET"]),
            Route("/admin/deployments/{name}", delete, methods=["DELETE"]),
            Route("/admin/deployments/{name}/scale", scale, methods=["POST"]),
            Route("/admin/fleet", fleet, methods=["GET"]),
            Route("/admin/events", events, methods=["GET"]),
        ]
    )
