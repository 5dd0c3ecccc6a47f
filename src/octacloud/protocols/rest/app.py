"""The Open Inference Protocol over HTTP: a lean ASGI app (no framework router on the hot path).

The endpoints are the OIP rows of the one table, ``protocols/endpoints.py`` (health, server and model metadata,
readiness, configuration, statistics, inference in JSON or Triton's binary tensor data, the repository
extension): a request's path is matched there and answered by the row's DataPlane operation.

Errors are ``{"error": "<message>"}`` with the status that :func:`octacloud.serving.status_of` gives the
error (400 bad request, 403 not allowed, 404 unknown model or version, 503 not ready, queue full or timed out,
500 the model failed), or 404/405 for an unknown path and 413 for a body over the limit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from octacloud.protocols.asgi import DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES
from octacloud.protocols.asgi import Headers, HttpError, content_length, read_body
from octacloud.protocols.endpoints import BY_NAME, MODEL_PREFIX, Match, oip_match
from octacloud.protocols.errorlog import BoundedErrorLog
from octacloud.protocols.internal import RequireSecret, http_refusal, tenant_of
from octacloud.protocols.openai.replica import GenerativeHttp1, generative_target
from octacloud.protocols.rest import codec
from octacloud.protocols.rest.bridge import AsgiBridge
from octacloud.protocols.rest.request import Http1Request, encode_headers
from octacloud.serving import DataPlane, InvalidInputError, status_of

log = logging.getLogger(__name__)
_errors = BoundedErrorLog(log)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Answer = tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]
"""An endpoint's answer: status, body, and its content-type and other headers (none: JSON)."""
Answering = Callable[["Match", Scope, Receive], Awaitable[Answer]]

HEADER_LENGTH = b"inference-header-content-length"
_JSON = (b"content-type", b"application/json")
_OCTET = (b"content-type", b"application/octet-stream")


class RestApp:
    """ASGI application over one :class:`DataPlane`."""

    def __init__(
        self, dataplane: DataPlane, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, *, trust_tenant: bool = False
    ) -> None:
        self.dataplane = dataplane
        self.max_body_bytes = max_body_bytes
        self.trust_tenant = trust_tenant
        """Read the gateway's tenant header (only behind the internal secret, protocols/internal.py)."""
        self.header_cache = codec.HeaderCache()
        """Inference headers parsed and encoded once (``codec.HeaderCache``)."""
        self._answers = self._answering()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except Exception as e:
            status, body, extra = error_answer(e, scope["method"], scope["path"])
            await _reply(send, status, body, _JSON, *extra)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        parts = scope["path"].strip("/").split("/")
        if not parts or parts[0] != "v2":
            raise HttpError(404, f"no endpoint {scope['path']}; the API is under /v2")
        found = oip_match(method, parts)
        answer = None if found is None else self._answers.get(found.endpoint.name)
        if found is None or answer is None:
            if method == "POST" and len(parts) >= 3 and parts[1] == "repository":
                await self._body(scope, receive)  # the repository extension reads its body before its path
            raise HttpError(404 if method in ("GET", "POST") else 405, f"no endpoint {method} {scope['path']}")
        status, body, headers = await answer(found, scope, receive)
        await _reply(send, status, body, *headers)

    def _answering(self) -> dict[str, Answering]:
        """Each endpoint of the table (``protocols/endpoints.py``) this app serves, by name: what answers it."""
        dp = self.dataplane

        def now(answer: Callable[[Match], Answer]) -> Answering:
            async def answering(found: Match, scope: Scope, receive: Receive) -> Answer:
                return answer(found)

            return answering

        def dumped(status: int, value: Any) -> Answer:
            return status, codec.dumps(value), ()

        return {
            "health_live": now(lambda m: (200 if dp.live() else 503, b"", ())),
            "health_ready": now(lambda m: (200 if dp.server_ready() else 503, b"", ())),
            "server_metadata": now(lambda m: dumped(200, codec.server_metadata(dp.server_metadata()))),
            "model_metadata": now(lambda m: dumped(200, codec.model_metadata(dp.model_metadata(m.model, m.version)))),
            "model_ready": now(self._ready),
            "model_config": now(lambda m: dumped(200, codec.message_to_json(dp.model_config(m.model, m.version)))),
            "model_stats": now(lambda m: dumped(200, codec.statistics(dp.model_statistics(m.model, m.version)))),
            "statistics": now(lambda m: dumped(200, codec.statistics(dp.model_statistics()))),
            "infer": self._infer,
            "repository_index": self._repository_index,
            "repository_load": self._repository_load,
            "repository_unload": self._repository_load,
        }

    def _ready(self, found: Match) -> Answer:
        if self.dataplane.model_ready(found.model, found.version):
            return 200, b"", ()
        return 400, codec.dumps({"error": f"model {found.model!r} is not ready"}), ()

    async def _infer(self, found: Match, scope: Scope, receive: Receive) -> Answer:
        body = await self._body(scope, receive)
        out, extra = await self.infer(found.model, found.version, scope["headers"], body)
        return 200, out, extra

    async def _repository_index(self, found: Match, scope: Scope, receive: Receive) -> Answer:
        body = await self._body(scope, receive)
        options = codec.loads(body) if body.strip() else {}
        ready = bool(options.get("ready", False)) if isinstance(options, dict) else False
        return 200, codec.dumps(codec.repository_index(self.dataplane.repository_index(ready))), ()

    async def _repository_load(self, found: Match, scope: Scope, receive: Receive) -> Answer:
        await self._body(scope, receive)
        dp = self.dataplane
        await (dp.load(found.model) if found.endpoint.name == "repository_load" else dp.unload(found.model))
        return 200, b"", ()

    async def infer(
        self, name: str, version: str, headers: Headers, body: bytes
    ) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
        """One inference request's answer: the body and its content-type (and binary-data) headers; raises what
        :func:`error_answer` turns into the error answer."""
        header_length = None
        for key, value in headers:
            if key == HEADER_LENGTH:
                try:
                    header_length = int(value)
                except ValueError:
                    raise InvalidInputError(
                        f"Inference-Header-Content-Length must be an integer, got {value.decode(errors='replace')!r}"
                    ) from None
        request = codec.decode_infer(body, header_length, name, version, self.header_cache)
        if self.trust_tenant:
            request = dataclasses.replace(request, tenant=tenant_of(headers))
        response = await self.dataplane.infer(request)
        out, json_length = codec.encode_infer(response, request, self.header_cache)
        if json_length is None:
            return out, (_JSON,)
        return out, (_OCTET, (HEADER_LENGTH, str(json_length).encode()))

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        content_length(scope["headers"], self.max_body_bytes)  # 413 before reading a body over the limit
        return await read_body(receive, self.max_body_bytes)


DEFAULT_BODY_TIMEOUT_S = 60.0
"""Seconds a request body may take to arrive once its head has."""
_JSON_LINES = encode_headers([_JSON])
_INFER = BY_NAME["infer"]
_INFER_SUFFIX = f"/{_INFER.action}"


class ReplicaHttp1:
    """The replica's REST on octacloud's HTTP/1.1 server (:class:`~octacloud.protocols.rest.server.Http1Server`).

    Inference (``POST /v2/models/<m>[/versions/<v>]/infer``) is answered here without an ASGI cycle: refused on
    its headers alone when it lacks the cloud's secret or names another replica (as :class:`RequireSecret`
    refuses), its announced length checked, its body read within ``body_timeout_s``, the answer written in one
    ``write``. Every other path runs :class:`RestApp` through :class:`AsgiBridge` (behind
    :class:`RequireSecret` when there is a secret), so it behaves as it does under any ASGI server."""

    def __init__(
        self,
        app: RestApp,
        secret: bytes | None = None,
        replica_id: str = "",
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.secret = secret
        self.replica_id = replica_id
        self.body_timeout_s = body_timeout_s
        self.bridge = AsgiBridge(app if secret is None else RequireSecret(app, secret, replica_id))
        self.generative = GenerativeHttp1(
            app.dataplane,
            secret=secret,
            replica_id=replica_id,
            max_body_bytes=app.max_body_bytes,
            body_timeout_s=body_timeout_s,
        )
        """OpenAI's API and Triton's generate extension (``protocols/openai/replica.py``)."""

    async def __call__(self, request: Http1Request) -> None:
        target = infer_target(request.path) if request.method == b"POST" else None
        if target is None:
            generative = generative_target(request.method, request.path)
            if generative is not None:
                await self.generative(request, generative)
                return
            await self.bridge(request)
            return
        app = self.app
        if self.secret is not None:
            refused = http_refusal(self.secret, self.replica_id, request.path, request.headers)
            if refused is not None:
                status, message = refused
                request.respond(status, _JSON_LINES, codec.dumps({"error": message}), close=not request.complete)
                return
        try:
            content_length(request.headers, app.max_body_bytes)  # 413 before reading a body over the limit
            try:
                body = await request.read_body(self.body_timeout_s)
            except TimeoutError:
                raise HttpError(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None
            out, headers = await app.infer(target[0], target[1], request.headers, body)
        except Exception as e:
            status, answer, extra = error_answer(e, "POST", request.path)
            lines = _JSON_LINES + encode_headers(extra) if extra else _JSON_LINES
            request.respond(status, lines, answer, close=not request.complete)
            return
        request.respond(200, _JSON_LINES if headers == (_JSON,) else encode_headers(headers), out)


def infer_target(path: str) -> tuple[str, str] | None:
    """``(model, version)`` of an inference path (``/v2/models/<m>[/versions/<v>]/infer``), else None."""
    if not path.startswith(MODEL_PREFIX) or not path.endswith(_INFER_SUFFIX):
        return None
    found = oip_match("POST", path.strip("/").split("/"))
    return (found.model, found.version) if found is not None and found.endpoint is _INFER else None


def error_answer(e: Exception, method: str, path: str) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]:
    """The status, ``{"error": ...}`` body and extra headers (``retry-after``) that answer ``e``; an unexpected
    error is logged (bounded) with the request's method and path."""
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if isinstance(e, HttpError):
        status = e.status
    else:
        answer = status_of(e)
        status = answer.http
        if answer.retry_after_s:
            extra = ((b"retry-after", b"%d" % answer.retry_after_s),)
        if not answer.expected:
            _errors.exception(f"{method} {path[:200]}", e)
    return status, codec.dumps({"error": str(e)}), extra


async def _reply(
    send: Send, status: int, body: bytes, content_type: tuple[bytes, bytes] = _JSON, *extra: tuple[bytes, bytes]
) -> None:
    headers = [content_type, (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
