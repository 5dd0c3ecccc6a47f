"""One table maps serving errors to REST statuses and gRPC codes; both adapters answer from it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.protocols.grpc.servicer import InferenceServicer
from octacloud.protocols.rest.app import RestApp
from octacloud.serving import (
    InvalidInputError,
    ModelConfigError,
    ModelExecutionError,
    ModelNotFoundError,
    ModelNotReadyError,
    NotAllowedError,
    QueueFullError,
    QueueTimeoutError,
    status_of,
)

TABLE = [
    (InvalidInputError("bad"), 400, "INVALID_ARGUMENT"),
    (InvalidSpecError("bad"), 400, "INVALID_ARGUMENT"),
    (ModelNotFoundError("nope"), 404, "NOT_FOUND"),
    (NotFoundError("nope"), 404, "NOT_FOUND"),
    (ModelNotReadyError("later"), 503, "UNAVAILABLE"),
    (QueueFullError("full"), 503, "UNAVAILABLE"),
    (QueueTimeoutError("late"), 503, "UNAVAILABLE"),
    (NotAllowedError("no"), 403, "FAILED_PRECONDITION"),
    (ModelConfigError("broken"), 400, "INVALID_ARGUMENT"),
    (ModelExecutionError("failed"), 500, "INTERNAL"),
    (RuntimeError("bug"), 500, "INTERNAL"),
]


class Raising:
    """A DataPlane whose every call raises one error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def model_metadata(self, name: str, version: str) -> Any:
        raise self.error

    async def load(self, name: str) -> None:
        raise self.error


class Aborted(Exception):
    pass


class Context:
    code: grpc.StatusCode | None = None
    details = ""
    trailing: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        self.code, self.details, self.trailing = code, details, tuple(trailing_metadata)
        raise Aborted


SHEDDING = (ModelNotReadyError, QueueFullError, QueueTimeoutError)
"""The replica answers these with when to retry: load shed, or a model still loading."""


async def rest_answer(app: RestApp, method: str, path: str) -> tuple[int, dict[str, Any]]:
    status, body, _ = await rest_reply(app, method, path)
    return status, body


async def rest_reply(app: RestApp, method: str, path: str) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"]), dict(sent[0]["headers"])


@pytest.mark.parametrize(("error", "http", "code"), TABLE, ids=lambda x: type(x).__name__ if x else "")
def test_rest_and_grpc_answer_each_error_from_the_one_table(error: Exception, http: int, code: str) -> None:
    assert (status_of(error).http, status_of(error).grpc) == (http, code)
    dataplane: Any = Raising(error)
    retry = isinstance(error, SHEDDING)
    assert status_of(error).retry_after_s == (1 if retry else 0)
    for method, path in (("GET", "/v2/models/m"), ("POST", "/v2/repository/models/m/load")):
        status, body, headers = asyncio.run(rest_reply(RestApp(dataplane), method, path))
        assert (status, body["error"]) == (http, str(error))
        assert headers.get(b"retry-after") == (b"1" if retry else None)
    servicer = InferenceServicer(dataplane)
    for call, request in (
        (servicer.ModelMetadata, pb.ModelMetadataRequest(name="m")),
        (servicer.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="m")),
    ):
        context = Context()
        with pytest.raises(Aborted):
            asyncio.run(call(request, context))
        assert (context.code, context.details) == (grpc.StatusCode[code], str(error))
        assert context.trailing == ((("retry-after", "1"),) if retry else ())


def test_only_unexpected_errors_are_logged_with_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for error in (InvalidInputError("bad"), ModelExecutionError("failed"), RuntimeError("bug")):
        asyncio.run(rest_answer(RestApp(Raising(error)), "GET", "/v2/models/m"))  # type: ignore[arg-type]
    logged = [r for r in caplog.records if r.exc_info]
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == ["bug"]


def test_internal_errors_are_logged_boundedly(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from octacloud.protocols.errorlog import BoundedErrorLog

    now = [0.0]
    errors = BoundedErrorLog(logging.getLogger("octacloud.test"), burst=3, window_s=60, clock=lambda: now[0])
    for _ in range(1000):
        errors.exception("GET /v2/x", RuntimeError("bug"))
    now[0] = 61.0
    errors.exception("GET /v2/x", RuntimeError("bug"))
    records = [r for r in caplog.records if r.name == "octacloud.test"]
    assert sum(1 for r in records if r.exc_info) == 4
    assert [r.getMessage() for r in records if not r.exc_info] == [
        "997 more internal errors in the last 60 s were not logged"
    ]
