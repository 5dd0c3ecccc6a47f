"""The Open Inference Protocol over HTTP: a lean ASGI app (no framework router on the hot path).

Endpoints (``[/versions/<v>]`` optional everywhere a model is named):

| method | path | |
|---|---|---|
| GET | /v2/health/live, /v2/health/ready | health |
| GET | /v2 | server metadata |
| GET | /v2/models/<m>[/versions/<v>] | model metadata |
| GET | /v2/models/<m>[/versions/<v>]/ready | model readiness |
| GET | /v2/models/<m>[/versions/<v>]/config | model configuration extension |
| GET | /v2/models[/<m>[/versions/<v>]]/stats | statistics extension |
| POST | /v2/models/<m>[/versions/<v>]/infer | inference (JSON, or Triton's binary tensor data) |
| POST | /v2/repository/index, /v2/repository/models/<m>/load, .../unload | repository extension |

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
from octacloud.protocols.asgi import HttpError, content_length, read_body
from octacloud.protocols.errorlog import BoundedErrorLog
from octacloud.protocols.internal import tenant_of
from octacloud.protocols.rest import codec
from octacloud.serving import DataPlane, InvalidInputError, status_of

log = logging.getLogger(__name__)
_errors = BoundedErrorLog(log)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except Exception as e:
            extra: tuple[tuple[bytes, bytes], ...] = ()
            if isinstance(e, HttpError):
                status = e.status
            else:
                answer = status_of(e)
                status = answer.http
                if answer.retry_after_s:
                    extra = ((b"retry-after", b"%d" % answer.retry_after_s),)
                if not answer.expected:
                    _errors.exception(f"{scope['method']} {scope['path'][:200]}", e)
            await _reply(send, status, codec.dumps({"error": str(e)}), _JSON, *extra)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        dp = self.dataplane
        method = scope["method"]
        parts = scope["path"].strip("/").split("/")
        if not parts or parts[0] != "v2":
            raise HttpError(404, f"no endpoint {scope['path']}; the API is under /v2")
        n = len(parts)
        if n >= 3 and parts[1] == "models" and parts[2] != "stats":
            name = parts[2]
            version, rest = "", parts[3:]
            if len(rest) >= 2 and rest[0] == "versions":
                version, rest = rest[1], rest[2:]
            action = rest[0] if len(rest) == 1 else ("" if not rest else None)
            if action == "infer" and method == "POST":
                await self._infer(scope, receive, send, name, version)
                return
            if method == "GET":
                if action == "":
                    await _reply(send, 200, codec.dumps(codec.model_metadata(dp.model_metadata(name, version))))
                    return
                if action == "ready":
                    ready = dp.model_ready(name, version)
                    await _reply(
                        send,
                        200 if ready else 400,
                        b"" if ready else codec.dumps({"error": f"model {name!r} is not ready"}),
                    )
                    return
                if action == "config":
                    await _reply(send, 200, codec.dumps(codec.message_to_json(dp.model_config(name, version))))
                    return
                if action == "stats":
                    await _reply(send, 200, codec.dumps(codec.statistics(dp.model_statistics(name, version))))
                    return
        elif method == "GET" and n == 1:
            await _reply(send, 200, codec.dumps(codec.server_metadata(dp.server_metadata())))
            return
        elif method == "GET" and n == 3 and parts[1] == "health":
            ok = dp.live() if parts[2] == "live" else dp.server_ready() if parts[2] == "ready" else None
            if ok is not None:
                await _reply(send, 200 if ok else 503, b"")
                return
        elif method == "GET" and n == 3 and parts[1:] == ["models", "stats"]:
            await _reply(send, 200, codec.dumps(codec.statistics(dp.model_statistics())))
            return
        elif method == "POST" and n >= 3 and parts[1] == "repository":
            body = await self._body(scope, receive)
            if parts[2:] == ["index"]:
                options = codec.loads(body) if body.strip() else {}
                ready = bool(options.get("ready", False)) if isinstance(options, dict) else False
                await _reply(send, 200, codec.dumps(codec.repository_index(dp.repository_index(ready))))
                return
            if n == 5 and parts[2] == "models" and parts[4] in ("load", "unload"):
                await (dp.load(parts[3]) if parts[4] == "load" else dp.unload(parts[3]))
                await _reply(send, 200, b"")
                return
        raise HttpError(404 if method in ("GET", "POST") else 405, f"no endpoint {method} {scope['path']}")

    async def _infer(self, scope: Scope, receive: Receive, send: Send, name: str, version: str) -> None:
        header_length = None
        for key, value in scope["headers"]:
            if key == HEADER_LENGTH:
                try:
                    header_length = int(value)
                except ValueError:
                    raise InvalidInputError(
                        f"Inference-Header-Content-Length must be an integer, got {value.decode(errors='replace')!r}"
                    ) from None
        body = await self._body(scope, receive)
        request = codec.decode_infer(body, header_length, name, version)
        if self.trust_tenant:
            request = dataclasses.replace(request, tenant=tenant_of(scope["headers"]))
        response = await self.dataplane.infer(request)
        out, json_length = codec.encode_infer(response, request)
        if json_length is None:
            await _reply(send, 200, out)
        else:
            await _reply(send, 200, out, _OCTET, (HEADER_LENGTH, str(json_length).encode()))

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        content_length(scope["headers"], self.max_body_bytes)  # 413 before reading a body over the limit
        return await read_body(receive, self.max_body_bytes)


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
