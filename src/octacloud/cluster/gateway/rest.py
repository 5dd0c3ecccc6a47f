"""The gateway's REST front end: a raw ASGI app that forwards OIP V2 requests to replicas.

Per-model paths (``/v2/models/<name>/...``) go to a ready replica of deployment ``<name>``; the server-level
paths (health, metadata) are answered by the gateway itself; ``GET .../stats`` asks every ready replica and
answers with the sum; ``/admin/...`` goes to the admin API. Bodies are
forwarded untouched, so JSON and Triton's binary tensor extension both work and cost no re-encoding.

With a :class:`Guard`, every path but ``/v2/health/live|ready`` needs ``Authorization: Bearer <key>`` (401
otherwise); a deployment the caller may not see answers 404 exactly as an unknown one does; a tenant over its
request rate gets 429 with ``Retry-After``. The verified principal reaches the admin API in
``scope["state"]["principal"]``; the key itself is never forwarded to a replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from octacloud import __version__
from octacloud.cluster.auth import ANONYMOUS_ADMIN, AuthError, Guard, Principal, RateLimitedError
from octacloud.cluster.gateway.routing import Endpoint, RouteTable
from octacloud.cluster.gateway.stats import merge_model_statistics
from octacloud.cluster.gateway.upstream import Response, UpstreamError, UpstreamPool

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_ATTEMPTS = 3
MAX_BODY_BYTES = 256 * 1024 * 1024
SERVER_EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "classification"]
_JSON = [(b"content-type", b"application/json")]


async def _reply(send: Send, status: int, payload: object, headers: list[tuple[bytes, bytes]] | None = None) -> int:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [*_JSON, *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
    return len(body)


async def _relay(send: Send, response: Response) -> int:
    """Pass a replica's answer on as it is (less its connection headers); returns the body's size."""
    headers = [(k, v) for k, v in response.headers if k.lower() not in (b"connection", b"keep-alive")]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
    return len(response.body)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class RestGateway:
    """ASGI app. ``ready`` is a callable so the gateway reports not-ready until the controller has started."""

    def __init__(
        self,
        routes: RouteTable,
        pool: UpstreamPool | None = None,
        admin: ASGIApp | None = None,
        ready: Callable[[], bool] = lambda: True,
        request_timeout: float = 60.0,
        guard: Guard | None = None,
        dashboard: ASGIApp | None = None,
        metrics: ASGIApp | None = None,
    ) -> None:
        self.dashboard = dashboard
        """``/dashboard...``: public static page; its JSON API checks the admin key itself."""
        self.metrics = metrics
        """``/metrics``: the cloud's Prometheus text; checks the admin key itself."""
        self.guard = guard
        """None only in tests of the proxy itself: then every caller is an anonymous admin."""
        self.routes = routes
        self.pool = pool or UpstreamPool()
        self.admin = admin
        self.ready = ready
        self.request_timeout = request_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path == "/v2/health/live":
            await _reply(send, 200, {"live": True})
            return
        if path == "/v2/health/ready":
            ok = self.ready()
            await _reply(send, 200 if ok else 503, {"ready": ok})
            return
        if path.startswith("/dashboard") and self.dashboard is not None:
            await self.dashboard(scope, receive, send)
            return
        if path == "/metrics" and self.metrics is not None:
            await self.metrics(scope, receive, send)
            return
        principal = await self._authorize(scope, send)
        if principal is None:
            return
        if path.startswith("/v2/models/"):
            await self._proxy(scope, receive, send, path, principal)
        elif path in ("/v2", "/v2/"):
            await _reply(send, 200, {"name": "octacloud", "version": __version__, "extensions": SERVER_EXTENSIONS})
        elif path.startswith("/admin") and self.admin is not None:
            scope.setdefault("state", {})["principal"] = principal
            await self.admin(scope, receive, send)
        else:
            await _reply(send, 404, {"error": f"no route for {scope['method']} {path}"})

    async def _authorize(self, scope: Scope, send: Send) -> Principal | None:
        """The caller, or None after answering 401 or 429."""
        if self.guard is None:
            return ANONYMOUS_ADMIN
        try:
            principal = self.guard.authorize(scope["headers"])
            self.guard.admit(principal)
        except AuthError as exc:
            await _reply(send, 401, {"error": str(exc)}, [(b"www-authenticate", b'Bearer realm="octacloud"')])
            return None
        except RateLimitedError as exc:
            await _reply(send, 429, {"error": str(exc)}, [(b"retry-after", str(exc.retry_after).encode())])
            return None
        return principal

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, path: str, principal: Principal) -> None:
        deployment = path[len("/v2/models/") :].split("/", 1)[0]
        started = time.perf_counter()
        owner = self.routes.owners.get(deployment)
        if deployment not in self.routes.routes or (
            self.guard is not None and (owner is None or not principal.may_see(owner.tenant, owner.published))
        ):
            await _reply(send, 404, {"error": f"unknown model or deployment '{deployment}'"})
            return
        body = await _read_body(receive, MAX_BODY_BYTES)
        if body is None:
            await _reply(send, 413, {"error": f"request body larger than {MAX_BODY_BYTES} bytes or incomplete"})
            return
        counters = self.routes.counter(deployment)
        usage = self.routes.tenant_traffic(principal.tenant, deployment)
        target = scope["raw_path"] or path.encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        tried: list[str] = []
        last_error = f"deployment '{deployment}' has no ready replica"
        counters.requests += 1
        counters.bytes_in += len(body)
        counters.outstanding += 1
        usage.requests += 1
        usage.bytes_in += len(body)
        headers_out = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
        try:
            if scope["method"] == "GET" and path.endswith("/stats"):
                sent = await self._statistics(send, deployment, target, headers_out)
                counters.bytes_out += sent
                usage.bytes_out += sent
                return
            for _ in range(MAX_ATTEMPTS):
                endpoint = self.routes.choose(deployment, tried)
                if endpoint is None:
                    break
                tried.append(endpoint.replica_id)
                endpoint.outstanding += 1
                try:
                    response = await self.pool.request(
                        endpoint.host,
                        endpoint.http_port,
                        scope["method"].encode(),
                        target,
                        headers_out,
                        body,
                        self.request_timeout,
                    )
                except UpstreamError as exc:
                    endpoint.failures += 1
                    last_error = str(exc)
                    continue
                except TimeoutError:
                    last_error = f"replica {endpoint.replica_id} did not answer within {self.request_timeout:g} s"
                    break
                finally:
                    endpoint.outstanding -= 1
                endpoint.failures = 0
                sent = await _relay(send, response)
                counters.bytes_out += sent
                usage.bytes_out += sent
                if response.status >= 400:
                    counters.failures += 1
                return
            counters.failures += 1
            sent = await _reply(send, 503, {"error": last_error}, [(b"retry-after", b"1")])
            counters.bytes_out += sent
            usage.bytes_out += sent
        finally:
            counters.outstanding -= 1
            counters.latency_us_total += int((time.perf_counter() - started) * 1e6)

    async def _statistics(self, send: Send, deployment: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> int:
        """Ask every ready replica of ``deployment`` and answer with the sum (see ``gateway.stats``)."""

        async def ask(endpoint: Endpoint) -> Response | None:
            try:
                return await self.pool.request(
                    endpoint.host, endpoint.http_port, b"GET", target, headers, b"", self.request_timeout
                )
            except (UpstreamError, TimeoutError):
                return None

        answers = [a for a in await asyncio.gather(*(ask(e) for e in self.routes.healthy(deployment))) if a is not None]
        if not answers:
            return await _reply(send, 503, {"error": f"deployment '{deployment}' has no ready replica"})
        refused = [a for a in answers if a.status != 200]
        if refused:  # e.g. an unknown version: every replica says the same, pass the first answer on
            return await _relay(send, refused[0])
        try:
            merged = merge_model_statistics(json.loads(a.body) for a in answers)
        except (ValueError, AttributeError) as exc:
            return await _reply(send, 502, {"error": f"a replica answered statistics that are not JSON: {exc}"})
        return await _reply(send, 200, merged)
