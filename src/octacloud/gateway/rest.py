"""The gateway's REST front end: a raw ASGI app that forwards OIP V2 requests to replicas.

What each inference path is comes from the endpoint table (``protocols/endpoints.py``): per-model paths
(``/v2/models/<name>/...``) go to a ready replica of deployment ``<name>``; the server-level paths (health,
metadata) are answered by the gateway itself; ``GET .../stats`` asks every ready replica and answers with the
sum; the generative rows go to ``gateway/openai.py``. ``/admin/...`` goes to the admin API. Bodies are
forwarded untouched, so JSON and Triton's binary tensor extension both work and cost no re-encoding.

With a :class:`Guard`, every path but ``/v2/health/live|ready`` needs ``Authorization: Bearer <key>`` (401
otherwise); a deployment the caller may not see answers 404 exactly as an unknown one does; a tenant over its
request rate gets 429 with ``Retry-After``. The verified principal reaches the admin API in
``scope["state"]["principal"]``; the key itself is never forwarded to a replica.

The key and the announced body size are checked on the headers, before the body is read (and before ``Expect:
100-continue`` is answered); ``Expect`` itself is never forwarded. A deployment with as many requests
in flight as its bound (:class:`GatewayLimits`) is refused at once with 503 and ``Retry-After``; a
deployment that exists but has no ready replica yet (start-up) is 503, not 404. Only answers that came from
a replica are billed to the caller, and no answer names a replica's address.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from octacloud import __version__
from octacloud.gateway.forward import Ask, Exhausted, Forwarding, TimedOut, Unanswered
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.openai import Admission, OpenAIFront, is_generative_path
from octacloud.gateway.routing import DeploymentCounters, Endpoint, NotAdmitted, RouteTable
from octacloud.gateway.stats import merge_model_statistics
from octacloud.gateway.upstream import HOP_BY_HOP, Response, UpstreamError, UpstreamPool
from octacloud.protocols.asgi import (
    ASGIApp,
    Headers,
    HttpError,
    Receive,
    Scope,
    Send,
    content_length,
    error_reply,
    header,
    json_reply,
    lifespan,
    read_body,
)
from octacloud.protocols.endpoints import deployment_of, gateway_answer, gateway_role
from octacloud.protocols.headers import DROPPED_FROM_CLIENTS
from octacloud.protocols.rest.bridge import AsgiBridge
from octacloud.protocols.rest.request import Http1Request, encode_headers
from octacloud.security.internal_auth import HEADER_BYTES, REPLICA_HEADER_BYTES, TENANT_HEADER_BYTES
from octacloud.tenancy import AuthError, Guard, Principal, RateLimitedError

log = logging.getLogger(__name__)

A = TypeVar("A")
SERVER_EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "classification"]
_DROPPED_REQUEST = frozenset({*(name.encode() for name in DROPPED_FROM_CLIENTS), *HOP_BY_HOP})
"""Never forwarded (names as the server lower-cased them): the credentials and the names only the gateway sets
(``protocols.headers``, the one policy of both fronts), nor what describes the client's connection
(``upstream.HOP_BY_HOP``)."""
_DROPPED_ANSWER = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server", HEADER_BYTES}
)
"""Not passed on from a replica's answer: its framing, and what the gateway's own server adds (``date``)."""
_CLOSE = (b"connection", b"close")
_UNAUTHORIZED = (b"www-authenticate", b'Bearer realm="octacloud"')
_JSON_LINE = b"content-type: application/json\r\n"
_SMALL_UNREAD = 64 * 1024
"""A refused request's unread body up to this size is read and dropped by the server (keep-alive kept);
a larger one, or one the client holds back for ``100 Continue``, closes the connection instead."""


async def _relay(send: Send, response: Response, head: bool = False) -> int:
    """Pass a replica's answer on (less its connection headers); returns the body's size."""
    headers = [(k, v) for k, v in response.headers if k.lower() not in _DROPPED_ANSWER]
    if head:  # a HEAD answer announces the GET's length and has no body
        headers += [(k, v) for k, v in response.headers if k.lower() == b"content-length"]
    elif response.status not in (204, 304):
        headers.append((b"content-length", str(len(response.body)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
    return len(response.body)


def _relay_native(request: Http1Request, response: Response, head: bool) -> None:
    """``_relay`` on the native server: the replica's end-to-end headers and body in one write."""
    lines = [b"%b: %b\r\n" % (k, v) for k, v in response.headers if k.lower() not in _DROPPED_ANSWER]
    if head:
        lines += [b"%b: %b\r\n" % (k, v) for k, v in response.headers if k.lower() == b"content-length"]
    request.respond(response.status, b"".join(lines), response.body, has_length=head)


def _refuse(request: Http1Request, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    """An error answer in the gateway's shape; ``connection: close`` among ``headers`` closes the connection."""
    close = _CLOSE in headers
    lines = _JSON_LINE + encode_headers([h for h in headers if h != _CLOSE])
    request.respond(status, lines, json.dumps({"error": message}).encode(), close=close)


def _unread_body_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """``Connection: close`` for an answer sent before the body was read, unless that body is small and coming."""
    return _unread_body(scope["headers"])


def _unread_body(headers: Headers) -> list[tuple[bytes, bytes]]:
    if header(headers, b"expect") is not None:
        return [_CLOSE]  # the client waits for 100 Continue that will not come: the body's end is unknowable
    if header(headers, b"transfer-encoding") is not None:
        return [_CLOSE]
    length = header(headers, b"content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > _SMALL_UNREAD):
        return [_CLOSE]
    return []


ADMIN_MAX_BODY_BYTES = 1 * 2**20
"""Admin API bodies are small JSON documents."""


def _small_body(scope: Scope) -> None:
    """An admin request's body must announce its length, at most ``ADMIN_MAX_BODY_BYTES`` (411/413 otherwise)."""
    if content_length(scope["headers"], ADMIN_MAX_BODY_BYTES) is None and header(
        scope["headers"], b"transfer-encoding"
    ):
        raise HttpError(411, "admin requests must send a Content-Length")


class RestGateway:
    """ASGI app. ``ready`` is a callable so the gateway reports not-ready until the controller has started."""

    def __init__(
        self,
        routes: RouteTable,
        pool: UpstreamPool | None = None,
        admin: ASGIApp | None = None,
        ready: Callable[[], bool] = lambda: True,
        request_timeout: float | None = None,
        guard: Guard | None = None,
        dashboard: ASGIApp | None = None,
        metrics: ASGIApp | None = None,
        limits: GatewayLimits | None = None,
        internal_secret: str | None = None,
        generation_limits: Admission | None = None,
    ) -> None:
        self.dashboard = dashboard
        """``/dashboard...``: public static page; its JSON API checks the admin key itself."""
        self.metrics = metrics
        """``/metrics``: the cloud's Prometheus text; checks the admin key itself."""
        self.core = Forwarding(routes, guard, limits or GatewayLimits(), ready)
        """The forwarding mechanism (``gateway/forward.py``); this front translates HTTP to it and back."""
        self.routes = routes
        self.guard = guard
        """None only in tests of the proxy itself: then every caller is an anonymous admin."""
        self.ready = ready
        self.limits = self.core.limits
        self.pool = pool or UpstreamPool()
        self.admin = admin
        self.request_timeout = self.limits.upstream_timeout_s if request_timeout is None else request_timeout
        """Seconds to wait for a replica's answer (``GatewayLimits.upstream_timeout_s`` unless given)."""
        self._internal = [(HEADER_BYTES, internal_secret.encode())] if internal_secret else []
        """Added to every request forwarded to a replica: it proves the request comes from this cloud."""
        self.openai = OpenAIFront(self, generation_limits)
        """OpenAI's API and Triton's generate extension, streamed (``gateway/openai.py``); a tenant's generation
        limits are ``generation_limits`` (a gateway worker's ask the main process), else this process's own."""
        routes.on_drop.append(lambda e: self.pool.forget(e.host, e.http_port))
        routes.on_gone.append(self._abandon)
        self._bridge = AsgiBridge(self)
        server = {"name": "octacloud", "version": __version__, "extensions": SERVER_EXTENSIONS}
        self._answers: dict[str, Callable[[], tuple[int, Any]]] = {
            "health_live": lambda: (200, {"live": True}),
            "health_ready": lambda: (200 if (ok := self.ready()) else 503, {"ready": ok}),
            "server_metadata": lambda: (200, server),
        }
        """The rows of the endpoint table (``protocols/endpoints.py``) the gateway answers itself, by name."""

    async def serve_http1(self, request: Http1Request) -> None:
        """The native handler (``protocols/rest/server.py``): inference and the other per-model routes without the
        ASGI cycle; every other path (and a model's ``/stats``, which asks every replica) through the ASGI app."""
        path = request.path
        if is_generative_path(request.method, path):
            await self.openai(request)
            return
        if gateway_role(request.method, path) != "forward":
            await self._bridge(request)
            return
        headers = request.headers
        try:
            principal = self.authorize(headers)
            await self._proxy_native(request, path, principal)
        except HttpError as exc:
            _refuse(
                request,
                exc.status,
                str(exc),
                [*exc.headers, *(_unread_body(headers) if exc.status != 408 else [_CLOSE])],
            )

    def authorize(self, headers: Headers) -> Principal:
        """The caller (on the headers alone: no body is read), else HttpError 401 or 429 with Retry-After."""
        try:
            return self.core.authorize(headers)
        except AuthError as exc:
            raise HttpError(401, str(exc), [_UNAUTHORIZED]) from None
        except RateLimitedError as exc:
            raise HttpError(429, str(exc), [(b"retry-after", str(exc.retry_after).encode())]) from None

    def admit(self, deployment: str, principal: Principal, unknown: str | None = None) -> DeploymentCounters:
        """The deployment's counters if this request may go on (on its headers alone), else HttpError: the cloud
        starting, no ready replica or its bound reached (503), a deployment the caller may not see (404, said as
        ``unknown`` where given)."""
        verdict = self.core.admit(deployment, principal)
        if isinstance(verdict, NotAdmitted):
            if verdict.why == "unknown":
                raise HttpError(404, unknown or verdict.message)
            raise HttpError(503, verdict.message, [(b"retry-after", b"1")])
        return verdict

    async def forward(
        self, deployment: str, counters: DeploymentCounters, size: int, ask: Ask[A], hold: bool = False
    ) -> tuple[A, Endpoint]:
        """``Forwarding.forward`` in HTTP's words: HttpError 503 with Retry-After when no replica answered, 504
        when the one asked did not answer in time."""
        try:
            return await self.core.forward(deployment, counters, size, ask, self.request_timeout, hold)
        except (Exhausted, TimedOut) as exc:
            raise _unforwarded(exc) from None

    async def _proxy_native(self, request: Http1Request, path: str, principal: Principal) -> None:
        deployment = deployment_of(path)
        counters = self.admit(deployment, principal)
        content_length(request.headers, self.limits.max_body_bytes)
        with self.core.flight(counters):
            try:
                body = await request.read_body(self.limits.body_timeout_s)
            except TimeoutError:
                raise HttpError(
                    408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
                ) from None
            target = request.raw_path
            if request.query:
                target += b"?" + request.query
            method = request.method
            response = await self._exchange(deployment, counters, principal, method, target, request.headers, body)
            _relay_native(request, response, method == b"HEAD")

    def _headers_out(self, headers: Headers, principal: Principal) -> list[tuple[bytes, bytes]]:
        """What a replica gets of the client's headers (names lower-case), with the cloud's own: the internal
        secret, and the calling tenant (per-tenant batches, ``protocols/internal.py``)."""
        out = [(k, v) for k, v in headers if k not in _DROPPED_REQUEST]
        out += self._internal
        out.append((TENANT_HEADER_BYTES, principal.tenant.encode()))
        return out

    async def _exchange(
        self,
        deployment: str,
        counters: DeploymentCounters,
        principal: Principal,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: bytes,
    ) -> Response:
        """A replica's answer to the request, counted and billed (a 5xx is not billed: the cloud's failure)."""
        headers_out = self._headers_out(headers, principal)

        async def ask(endpoint: Endpoint) -> Response:
            named = [*headers_out, (REPLICA_HEADER_BYTES, endpoint.replica_id.encode())]
            try:
                response = await self.pool.request(
                    endpoint.host, endpoint.http_port, method, target, named, body, self.request_timeout, filtered=True
                )
            except UpstreamError as exc:
                raise Unanswered(str(exc)) from None
            if response.status == 421:  # another process has the address: the replica is not there any more
                raise Unanswered(_misdirected(response))
            return response

        try:  # the core itself, not self.forward: one coroutine less on every request's path
            response, _ = await self.core.forward(deployment, counters, len(body), ask, self.request_timeout)
        except (Exhausted, TimedOut) as exc:
            raise _unforwarded(exc) from None
        status, usage = response.status, self.routes.tenant_traffic(principal.tenant, deployment)
        self.core.settle(counters, usage, len(body), len(response.body), failed=status >= 400, billed=status < 500)
        return response

    @property
    def internal(self) -> list[tuple[bytes, bytes]]:
        """The headers that prove a forwarded request comes from this cloud (its internal secret)."""
        return self._internal

    def _abandon(self, endpoint: Endpoint) -> None:
        """The controller found ``endpoint``'s replica dead: what is in flight there is retried elsewhere now."""
        ended = self.pool.abandon(endpoint.host, endpoint.http_port, "the controller found it stopped")
        if ended:
            log.warning("replica %s stopped with %d request(s) in flight: retried on another replica",
                        endpoint.replica_id, ended)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.pool.close)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        answered = gateway_answer(path)
        if answered is not None and answered.open:  # health: no key
            await json_reply(send, *self._answers[answered.name]())
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
        role = gateway_role(scope["method"], path)
        if role is not None:
            try:
                await self._proxy(scope, receive, send, path, principal, fan_out=role == "fan_out")
            except HttpError as exc:
                await error_reply(send, exc, _unread_body_headers(scope) if exc.status != 408 else [_CLOSE])
        elif answered is not None:
            await json_reply(send, *self._answers[answered.name]())
        elif path.startswith("/admin") and self.admin is not None:
            try:
                _small_body(scope)
            except HttpError as exc:
                await error_reply(send, exc, [_CLOSE])
                return
            scope.setdefault("state", {})["principal"] = principal
            await self.admin(scope, receive, send)
        else:
            await json_reply(
                send, 404, {"error": f"no route for {scope['method']} {path}"}, _unread_body_headers(scope)
            )

    async def _authorize(self, scope: Scope, send: Send) -> Principal | None:
        """The caller, or None after answering 401 or 429 (on the headers alone: no body is read)."""
        try:
            return self.authorize(scope["headers"])
        except HttpError as exc:
            await error_reply(send, exc, _unread_body_headers(scope))
            return None

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, path: str, principal: Principal, fan_out: bool
    ) -> None:
        deployment = deployment_of(path)
        counters = self.admit(deployment, principal)
        content_length(scope["headers"], self.limits.max_body_bytes)
        with self.core.flight(counters):
            try:
                async with asyncio.timeout(self.limits.body_timeout_s):  # a timer, not a task (as wait_for makes)
                    body = await read_body(receive, self.limits.max_body_bytes)
            except TimeoutError:
                wait = self.limits.body_timeout_s
                raise HttpError(408, f"the request body did not arrive within {wait:g} s") from None
            target = scope["raw_path"] or path.encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            method = scope["method"]
            if fan_out:
                headers_out = self._headers_out(scope["headers"], principal)  # ASGI names are lower-case
                sent = await self._statistics(send, deployment, counters, target, headers_out, len(body))
                usage = self.routes.tenant_traffic(principal.tenant, deployment)
                self.core.settle(counters, usage, len(body), sent, failed=False, billed=True)
                return
            response = await self._exchange(
                deployment, counters, principal, method.encode(), target, scope["headers"], body
            )
            await _relay(send, response, head=method == "HEAD")

    async def _statistics(
        self,
        send: Send,
        deployment: str,
        counters: DeploymentCounters,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        size: int,
    ) -> int:
        """Ask every ready replica of ``deployment`` and answer with the sum (see ``gateway.stats``)."""

        async def ask(endpoint: Endpoint) -> Response | None:
            named = [*headers, (REPLICA_HEADER_BYTES, endpoint.replica_id.encode())]
            try:
                answer = await self.pool.request(
                    endpoint.host, endpoint.http_port, b"GET", target, named, b"", self.request_timeout
                )
            except (UpstreamError, TimeoutError):
                return None
            return None if answer.status == 421 else answer  # not the replica meant: its figures are not ours

        answers = await self.core.fan_out(deployment, counters, size, ask)
        if not answers:
            raise HttpError(503, f"deployment '{deployment}' has no ready replica", [(b"retry-after", b"1")])
        refused = [a for a in answers if a.status != 200]
        if refused:  # e.g. an unknown version: every replica says the same, pass the first answer on
            return await _relay(send, refused[0])
        try:
            merged = merge_model_statistics(json.loads(a.body) for a in answers)
        except (ValueError, AttributeError) as exc:
            return await json_reply(send, 502, {"error": f"a replica answered statistics that are not JSON: {exc}"})
        return await json_reply(send, 200, merged)


def _unforwarded(exc: Exhausted | TimedOut) -> HttpError:
    """What the core's "no replica answered" is over HTTP: 503 with Retry-After, or 504 when the one asked did not
    answer in time."""
    if isinstance(exc, Exhausted):
        return HttpError(503, str(exc), [(b"retry-after", str(exc.retry_after).encode())])
    return HttpError(504, str(exc))


def _misdirected(response: Response) -> str:
    """The replica's own words for a 421 (it is not the replica the gateway meant)."""
    try:
        return f"misdirected: {json.loads(response.body)['error']}"
    except (ValueError, KeyError, TypeError):
        return "misdirected: the process at the replica's address is another one"
