"""Admin routes for rollouts and the controller's own state (``octacloud rollout ...`` calls them).

* ``GET /admin/deployments/{name}/rollout``: revisions, and which replicas run the current one;
* ``POST /admin/deployments/{name}/rollout/undo`` (body ``{}`` or ``{"revision": N}``): roll back, replica by
  replica, to the previous revision (or revision N);
* ``GET /admin/controller``: whether the controller's loop runs, failures, moves (admins only).

A tenant reaches only its own deployments (others answer 404, as a missing one does).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from octacloud.cluster.auth import Principal
from octacloud.cluster.auth.api import unauthenticated
from octacloud.cluster.controller import Controller
from octacloud.core.errors import InvalidSpecError, NotFoundError


def rollout_routes(controller: Controller, caller: Callable[[Request], Principal | None]) -> list[Route]:
    def owned(p: Principal, name: str) -> None:
        d = controller.store.get_deployment(name)
        if not p.may_manage(d.spec.tenant):
            raise NotFoundError(f"no deployment named {name!r}")

    async def status(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        name = request.path_params["name"]
        try:
            owned(p, name)
            return JSONResponse(controller.rollout_status(name))
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    async def undo(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        name = request.path_params["name"]
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            return JSONResponse({"error": "request body must be a JSON object"}, status_code=400)
        revision = body.get("revision") if isinstance(body, dict) else "bad"
        if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool)):
            return JSONResponse({"error": 'body must be {} or {"revision": <integer>}'}, status_code=400)
        try:
            owned(p, name)
            controller.rollout_undo(name, revision)
            return JSONResponse(controller.rollout_status(name))
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except InvalidSpecError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    async def state(request: Request) -> JSONResponse:
        p = caller(request)
        if p is None:
            return unauthenticated()
        if not p.is_admin:
            return JSONResponse({"error": "the controller's state is visible to admin keys only"}, status_code=403)
        ok, why = controller.ready()
        h, stats = controller.loop_health, controller.scheduling
        return JSONResponse(
            {
                "ready": ok,
                "reason": why,
                "running": h.running,
                "failed_iterations": h.failures,
                "last_error": h.last_error,
                "passes": controller.loop.passes,
                "defragmentation_moves": stats.defragmentation_moves,
                "preemptions": stats.preemptions,
            }
        )

    return [
        Route("/admin/deployments/{name}/rollout", status, methods=["GET"]),
        Route("/admin/deployments/{name}/rollout/undo", undo, methods=["POST"]),
        Route("/admin/controller", state, methods=["GET"]),
    ]
