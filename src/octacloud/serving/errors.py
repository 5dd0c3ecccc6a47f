"""Errors a client or a model can cause while serving, each carrying its REST status and gRPC code.

This module is the one table every protocol adapter reads (:func:`status_of`); no adapter keeps its own.

| error | REST | gRPC |
|---|---|---|
| :class:`InvalidInputError` (and any :class:`~octacloud.core.errors.InvalidSpecError`) | 400 | INVALID_ARGUMENT |
| :class:`ModelNotFoundError` (and any :class:`~octacloud.core.errors.NotFoundError`) | 404 | NOT_FOUND |
| :class:`ModelNotReadyError` | 503 + Retry-After 1 | UNAVAILABLE + retry-after 1 (trailing metadata) |
| :class:`QueueFullError`, :class:`QueueTimeoutError` (load shed) | 503 + Retry-After 1 | UNAVAILABLE + retry-after 1 |
| :class:`NotAllowedError` | 403 | FAILED_PRECONDITION |
| :class:`ModelConfigError` (a broken model named by a load request) | 400 | INVALID_ARGUMENT |
| :class:`ModelExecutionError` | 500 | INTERNAL |
| anything else (a bug: logged) | 500 | INTERNAL |

gRPC codes are given by name (``grpc.StatusCode[name]``) so that this layer imports no gRPC. A refusal that
says when to retry is the replica *answering* (it sheds load, or the model is loading): a gateway passes it on
and keeps routing to the replica, where a transport failure (no answer) counts towards ejecting it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    """How a protocol answers an error: REST status, gRPC status code name, and whether it is expected
    (a client's or a model's doing) or a bug to log with its traceback."""

    http: int
    grpc: str
    expected: bool = True
    retry_after_s: int = 0
    """Seconds a client should wait before retrying (``Retry-After`` / ``retry-after`` metadata); 0: none."""


INTERNAL = ErrorStatus(500, "INTERNAL", expected=False)


class ServingError(OctacloudError):
    """Base of every error raised while serving a request."""

    status: ClassVar[ErrorStatus] = INTERNAL


class InvalidInputError(ServingError, InvalidSpecError):
    """The request is malformed: names the input, its shape or datatype, and what was expected."""

    status = ErrorStatus(400, "INVALID_ARGUMENT")


class ModelNotFoundError(ServingError, NotFoundError):
    """No such model, or no such version of it, in the repository."""

    status = ErrorStatus(404, "NOT_FOUND")


class ModelNotReadyError(ServingError):
    """The model (version) exists but is loading, unloading or failed to load."""

    status = ErrorStatus(503, "UNAVAILABLE", retry_after_s=1)


class QueueFullError(ServingError):
    """The model's queue is at ``max_queue_size``: retry later."""

    status = ErrorStatus(503, "UNAVAILABLE", retry_after_s=1)


class QueueTimeoutError(ServingError):
    """The request waited in the queue longer than its timeout and the policy rejects on timeout."""

    status = ErrorStatus(503, "UNAVAILABLE", retry_after_s=1)


class NotAllowedError(ServingError):
    """The operation is not allowed here (e.g. explicit load in model control mode ``none``)."""

    status = ErrorStatus(403, "FAILED_PRECONDITION")


class ModelExecutionError(ServingError):
    """The model raised while computing a batch."""

    status = ErrorStatus(500, "INTERNAL")


class ModelConfigError(OctacloudError):
    """A model in the repository is broken: missing files, bad config.pbtxt, broken ONNX, wrong shapes."""

    status: ClassVar[ErrorStatus] = ErrorStatus(400, "INVALID_ARGUMENT")


_GENERIC: tuple[tuple[type[Exception], ErrorStatus], ...] = (
    (InvalidSpecError, InvalidInputError.status),
    (NotFoundError, ModelNotFoundError.status),
)


def status_of(error: BaseException) -> ErrorStatus:
    """The one answer to ``error`` for every protocol (see the table above)."""
    status = getattr(type(error), "status", None)
    if isinstance(status, ErrorStatus) and isinstance(error, ServingError | ModelConfigError):
        return status
    for kind, generic in _GENERIC:
        if isinstance(error, kind):
            return generic
    return INTERNAL
