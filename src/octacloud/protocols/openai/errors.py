"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, the status from the one error
table (:func:`octacloud.serving.status_of`), the ``type`` from the status as OpenAI names them."""

from __future__ import annotations

import json

from octacloud.protocols.asgi import HttpError
from octacloud.protocols.openai.schema import BadRequest
from octacloud.serving import status_of

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"message": message, "type": kind, "param": param, "code": code or _CODES.get(status)}
    return json.dumps({"error": body}).encode()


def answer_of(error: BaseException) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """Status, OpenAI-shaped body and extra headers (``retry-after``) for ``error``."""
    headers: list[tuple[bytes, bytes]] = []
    if isinstance(error, HttpError):
        status = error.status
        headers = [h for h in error.headers if h[0] == b"retry-after"]
    else:
        found = status_of(error)
        status = found.http
        if found.retry_after_s:
            headers.append((b"retry-after", b"%d" % found.retry_after_s))
    param = error.param if isinstance(error, BadRequest) else None
    code = getattr(error, "code", None)
    return status, error_body(status, str(error), param, code if isinstance(code, str) else None), headers
