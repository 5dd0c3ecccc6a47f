"""Protocol-agnostic inference: model runtime, repository, dynamic batching, and the DataPlane that every
front end calls. Imports no web or gRPC framework."""

from octacloud.serving.dataplane import DataPlane, VersionStats
from octacloud.serving.errors import (
    ErrorStatus,
    InvalidInputError,
    ModelConfigError,
    ModelExecutionError,
    ModelNotFoundError,
    ModelNotReadyError,
    NotAllowedError,
    QueueFullError,
    QueueTimeoutError,
    ServingError,
    status_of,
)
from octacloud.serving.model import ModelState, ModelVersion
from octacloud.serving.repository.repository import ControlMode, ModelRepository, RepositoryEntry, is_model_name
from octacloud.serving.runtime import ModelRuntime, OnnxRuntime, RuntimeFactory, default_runtimes
from octacloud.serving.types import (
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    RequestedOutput,
    ServerMetadata,
    Tensor,
    TensorMetadata,
)

__all__ = [
    "ControlMode",
    "DataPlane",
    "ErrorStatus",
    "InferenceRequest",
    "InferenceResponse",
    "InvalidInputError",
    "ModelConfigError",
    "ModelExecutionError",
    "ModelMetadata",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "ModelRepository",
    "ModelRuntime",
    "ModelState",
    "ModelVersion",
    "NotAllowedError",
    "OnnxRuntime",
    "QueueFullError",
    "QueueTimeoutError",
    "RepositoryEntry",
    "RequestedOutput",
    "RuntimeFactory",
    "ServerMetadata",
    "ServingError",
    "Tensor",
    "TensorMetadata",
    "VersionStats",
    "default_runtimes",
    "is_model_name",
    "status_of",
]
