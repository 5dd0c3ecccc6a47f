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

from octacloud.control.controller import Controller
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.tenancy import Principal
from octacloud.tenancy.api import ADMIN_ONLY, ForbiddenError, json_object


def rollout_routes(controller: Controller, caller: Callable[[Request], Principal]) -> list[Route]:
    """The routes; ``caller`` gives the verified principal or raises (the app's exception handlers answer)."""

    def owned(request: Request) -> str:
        name: str = request.path_params["name"]
        if not caller(request).may_manage(controller.store.get_deployment(name).spec.tenant):
            raise NotFoundError(f"no deployment named {name!r}")
        return name

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(controller.rollout_status(owned(request)))

    async def undo(request: Request) -> JSONResponse:
        name = owned(request)
        body = await json_object(request) if await request.body() else {}
        revision = body.get("revision")
        if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool)):
            raise InvalidSpecError('body must be {} or {"revision": <integer>}')
        controller.rollout_undo(name, revision)
        return JSONResponse(controller.rollout_status(name))

    async def state(request: Request) -> JSONResponse:
        if not caller(request).is_admin:
            raise ForbiddenError(ADMIN_ONLY)
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
