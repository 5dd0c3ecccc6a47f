"""The admin API, dashboard and ``/metrics`` behind gateway workers: served by the main process, reached from any
worker.

The main process keeps the controller, the store and the ledger, so it alone answers ``/admin``, ``/dashboard``
and ``/metrics``. It serves them on a loopback port behind :class:`InternalOnly`, which refuses (403) any request
without the cloud's internal secret; each worker's REST gateway hands those paths to an :class:`AdminProxy`,
which forwards them there with the secret (and the caller's own ``Authorization``: the main process checks the
key again, so a worker never grants what the key does not).
"""

from __future__ import annotations

from octacloud.gateway.upstream import HOP_BY_HOP, UpstreamError, UpstreamPool
from octacloud.protocols.asgi import ASGIApp, HttpError, Receive, Scope, Send, error_reply, json_reply, read_body
from octacloud.security.internal_auth import HEADER_BYTES, matches

PATHS = ("/admin", "/dashboard", "/metrics")
MAX_BODY_BYTES = 1 * 2**20
"""Admin API bodies are small JSON documents (as at the single-process gateway)."""
_DROPPED_ANSWER = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", HEADER_BYTES}


def _internal_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PATHS)


class InternalOnly:
    """ASGI wrapper on the main process's internal port: the secret or 403; only the admin paths, else 404."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan
            return
        presented = next((v for k, v in scope["headers"] if k == HEADER_BYTES), None)
        if not matches(self.secret, presented):
            self.refused += 1
            await json_reply(send, 403, {"error": "this port serves the cloud's gateway workers only"})
            return
        if not _internal_path(scope["path"]):
            await json_reply(send, 404, {"error": f"no route for {scope['method']} {scope['path']}"})
            return
        await self.app(scope, receive, send)


class AdminProxy:
    """ASGI app in a worker: forwards a request for the admin paths to the main process's internal port."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float = 60.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._secret = (HEADER_BYTES, secret.encode())
        self.pool = UpstreamPool()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            body = await read_body(receive, MAX_BODY_BYTES)
        except HttpError as exc:
            await error_reply(send, exc, [(b"connection", b"close")])
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != HEADER_BYTES]
        headers.append(self._secret)
        method: str = scope["method"]
        try:
            answer = await self.pool.request(
                self.host, self.port, method.encode(), target, headers, body, self.timeout_s
            )
        except (UpstreamError, TimeoutError) as exc:
            await json_reply(
                send, 503, {"error": f"the cloud's main process did not answer: {exc}"}, [(b"retry-after", b"1")]
            )
            return
        out = [(k, v) for k, v in answer.headers if k.lower() not in _DROPPED_ANSWER]
        if method == "HEAD":
            out += [(k, v) for k, v in answer.headers if k.lower() == b"content-length"]
        elif answer.status not in (204, 304):
            out.append((b"content-length", str(len(answer.body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": out})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else answer.body})

    async def close(self) -> None:
        await self.pool.close()
