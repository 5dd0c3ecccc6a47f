"""The extender's HTTP front: the verbs kube-scheduler POSTs to, health, and a view of the placements.

``POST /filter``, ``/bind``: always 200 with the verb's result, whose ``Error`` says what was wrong with a bad
request (kube-scheduler shows it in the pod's events). ``POST /prioritize``, ``/preempt`` (their results have no
error field): 400 with ``{"Error": ...}`` for a bad request. A body that is not JSON, too large, or a failure of
the extender itself never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from octacloud.k8s.api import ApiError, KubeClient, pods_path
from octacloud.k8s.extender import Extender, ExtenderError

log = logging.getLogger("octacloud.k8s.extender")

MAX_BODY_BYTES = 256 * 1024 * 1024
"""A NodeList of 5,000 nodes is ~50 MB; anything beyond this is refused."""

Verb = Callable[[Any], Awaitable[Any]]


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def build_extender_app(extender: Extender, *, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    def endpoint(verb: Verb, errors_in_body: bool) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                body = await _read(request, max_body_bytes)
                args = json.loads(body)
            except ExtenderError as exc:
                return _bad(str(exc), errors_in_body)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                return _bad(f"the request body is not JSON: {exc}", errors_in_body)
            try:
                async with extender.lock:
                    result = await verb(args)
            except ExtenderError as exc:
                return _bad(str(exc), errors_in_body)
            except Exception as exc:  # a bug must cost one answer, not the server
                log.exception("extender: %s failed", request.url.path)
                return _bad(f"octacloud extender failed: {type(exc).__name__}: {exc}", errors_in_body, status=500)
            return _JSON(result)

        return handle

    async def healthz(_: Request) -> Response:
        state = extender.state
        return JSONResponse({"ok": True, "nodes": len(state), "pods": len(state.allocations), "calls": extender.calls})

    async def placements(_: Request) -> Response:
        return JSONResponse(
            {
                uid: {"node": p.node, "cards": list(p.gpus), "milli": p.milli_per_gpu}
                for uid, p in extender.placements().items()
            }
        )

    routes = [
        Route("/filter", endpoint(extender.filter, True), methods=["POST"]),
        Route("/prioritize", endpoint(extender.prioritize, False), methods=["POST"]),
        Route("/bind", endpoint(extender.bind, True), methods=["POST"]),
        Route("/preempt", endpoint(extender.preempt, False), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/placements", placements, methods=["GET"]),
    ]
    return Starlette(routes=routes)


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ExtenderError(f"the request body is {declared} bytes; at most {limit} are accepted")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ExtenderError(f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _bad(message: str, errors_in_body: bool, status: int = 400) -> Response:
    if errors_in_body:
        return _JSON({"Error": message})
    return _JSON({"Error": message}, status_code=status)


async def serve_extender(extender: Extender, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve until ``stop``: the state is rebuilt from the API at start and every ``resync_s``, and a watch of
    the pods keeps it current in between."""
    await extender.resync()
    server = uvicorn.Server(
        uvicorn.Config(build_extender_app(extender), host=host, port=port, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # the CLI owns signals
    task = asyncio.create_task(server.serve())
    watch = asyncio.create_task(follow_pods(extender, extender.api)) if extender.api is not None else None
    try:
        while not stop.is_set() and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), extender.settings.resync_s)
            if stop.is_set() or task.done():
                break
            try:
                await extender.resync()
            except Exception:  # the API server away for a while: keep serving on what we know
                log.exception("extender: resync failed; retrying in %.0f s", extender.settings.resync_s)
    finally:
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        server.should_exit = True
        await task


async def follow_pods(extender: Extender, api: KubeClient, retry_s: float = 1.0) -> None:
    """Watch every pod from the last resync's version and hand each event to :meth:`Extender.observe`. An expired
    version (410) or a watch the server ended starts again from a fresh list; an API away is retried."""
    version = ""
    while True:
        try:
            if not version:
                version = await extender.resync()
            async for event in api.watch(pods_path(), version):
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    log.info("extender: the pod watch ended (%s); listing again", obj.get("message", obj))
                    version = ""
                    break
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    async with extender.lock:
                        extender.observe(str(kind), obj)
        except ApiError as exc:
            log.warning("extender: the pod watch failed (%s); again in %.0f s", exc, retry_s)
            version = ""
            await asyncio.sleep(retry_s)
        except Exception:  # a bug in one event must not stop following the pods
            log.exception("extender: the pod watch failed; listing again in %.0f s", retry_s)
            version = ""
            await asyncio.sleep(retry_s)
