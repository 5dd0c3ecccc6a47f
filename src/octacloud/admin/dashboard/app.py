"""The operator's dashboard, served by the gateway under ``/dashboard``, and the cloud's ``/metrics``.

The page is static (``static/``: HTML, two scripts, one stylesheet; no build step) and polls
``/dashboard/api/state`` once a second. Static files carry no data and are public; the JSON API and ``/metrics``
ask the injected ``authorize(headers)`` callable, which the cloud wires to its admin-key check when auth is on.

The key never travels in a URL: the page asks for it in a form, keeps it in ``sessionStorage`` (gone when the tab
closes) and sends it as ``Authorization: Bearer <key>`` on every poll, so it appears in no access log, browser
history or Referer header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

Authorize = Callable[[Mapping[str, str]], bool]
"""Request headers → may this caller see the whole fleet? Must be cheap and must not raise."""

StateSource = Callable[[float], Mapping[str, Any]]
"""``since`` (wall-clock seconds) → the dashboard document (see ``dashboard.state``)."""

_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_NO_STORE = {"cache-control": "no-store"}
_UNAUTHORIZED = {"error": "the dashboard needs the admin key (Authorization: Bearer <key>)"}
GZIP_MIN_BYTES = 4096
"""Answers from this size on go gzip-compressed to a client that accepts it: the document of a thousand cards is
~800 KiB of JSON, polled every second, and a few per cent of that compressed."""


def allow_all(_: Mapping[str, str]) -> bool:
    """The authorizer when auth is off."""
    return True


def _static(name: str) -> bytes:
    return resources.files("octacloud.admin.dashboard").joinpath("static", name).read_bytes()


def build_dashboard_app(state: StateSource, authorize: Authorize = allow_all) -> Starlette:
    files = {name: (_static(name), media) for name, media in _STATIC.items()}  # read once: no disk I/O per hit

    async def root(_: Request) -> Response:
        return RedirectResponse("/dashboard/", status_code=308)

    async def page(request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        found = files.get(name)
        if found is None:
            return JSONResponse({"error": f"no dashboard file {name!r}"}, status_code=404)
        body, media = found
        return Response(body, media_type=media, headers={"cache-control": "no-cache"})

    async def api_state(request: Request) -> Response:
        if not authorize(request.headers):
            return JSONResponse(_UNAUTHORIZED, status_code=401, headers={"www-authenticate": "Bearer"})
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError:
            return JSONResponse({"error": "since must be a number (seconds since the epoch)"}, status_code=400)
        return JSONResponse(state(since), headers=_NO_STORE)

    return Starlette(
        routes=[
            Route("/dashboard", root, methods=["GET"]),
            Route("/dashboard/", page, methods=["GET"]),
            Route("/dashboard/api/state", api_state, methods=["GET"]),
            Route("/dashboard/{name}", page, methods=["GET"]),
        ],
        middleware=[Middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES)],
    )


def build_metrics_app(registry: CollectorRegistry, authorize: Authorize = allow_all) -> Starlette:
    """``GET /metrics``: the registry in Prometheus text format (scrapers send the key as a bearer token)."""

    async def metrics(request: Request) -> Response:
        if not authorize(request.headers):
            return JSONResponse(_UNAUTHORIZED, status_code=401, headers={"www-authenticate": "Bearer"})
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


__all__ = ["Authorize", "StateSource", "allow_all", "build_dashboard_app", "build_metrics_app"]
