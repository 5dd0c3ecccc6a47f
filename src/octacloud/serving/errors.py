"""Errors a client or a model can cause while serving. Protocol adapters map each kind to a status.

| error | REST | gRPC |
|---|---|---|
| :class:`InvalidInputError` | 400 | INVALID_ARGUMENT |
| :class:`ModelNotFoundError` | 404 | NOT_FOUND |
| :class:`ModelNotReadyError` | 503 | UNAVAILABLE |
| :class:`QueueFullError`, :class:`QueueTimeoutError` | 503 | UNAVAILABLE |
| :class:`NotAllowedError` | 400 (403 for a control mode) | FAILED_PRECONDITION |
| :class:`ModelExecutionError` | 500 | INTERNAL |
"""

from __future__ import annotations

from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError


class ServingError(OctacloudError):
    """Base of every error raised while serving a request."""


class InvalidInputError(ServingError, InvalidSpecError):
    """The request is malformed: names the input, its shape or datatype, and what was expected."""


class ModelNotFoundError(ServingError, NotFoundError):
    """No such model, or no such version of it, in the repository."""


class ModelNotReadyError(ServingError):
    """The model (version) exists but is loading, unloading or failed to load."""


class QueueFullError(ServingError):
    """The model's queue is at ``max_queue_size``: retry later."""


class QueueTimeoutError(ServingError):
    """The request waited in the queue longer than its timeout and the policy rejects on timeout."""


class NotAllowedError(ServingError):
    """The operation is not allowed here (e.g. explicit load in model control mode ``none``)."""


class ModelExecutionError(ServingError):
    """The model raised while computing a batch."""


class ModelConfigError(OctacloudError):
    """A model in the repository is broken: missing files, bad config.pbtxt, broken ONNX, wrong shapes."""
