"""The inference endpoints, declared once: the replica's REST app dispatches from this table, its gRPC servicer
offers the table's gRPC methods, the internal secret leaves the table's open endpoints open, and the gateway
classifies a request's path by it.

Each :class:`Endpoint` names its HTTP method and path pattern (``{model}`` is the deployment, named in the path;
``[/versions/{version}]`` may be left out; ``{name}`` is a model of the replica's repository), the gRPC method of
Triton's ``GRPCInferenceService`` it corresponds to, the :class:`~octacloud.serving.DataPlane` operation that
answers it, whether it is open (health: no key, no internal secret), and what the gateway does with it:

| ``gateway`` | |
|---|---|
| ``answer`` | the gateway answers it itself (health, server metadata, the models a caller may see) |
| ``forward`` | forwarded to one ready replica of the deployment the path names (retried on another) |
| ``fan_out`` | asked of every ready replica of the deployment, answered with the sum (statistics) |
| ``stream`` | the generative front (``gateway/openai.py``): admitted by token budget, relayed as it comes |
| ``none`` | served by a replica only (the repository extension, all models' statistics) |

Adding an endpoint is one row here and its DataPlane method, with its handler in each front that serves it
(``tests/protocols/test_endpoints.py`` checks that every row is served and every served method is a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GatewayRole = Literal["answer", "forward", "fan_out", "stream", "none"]
Api = Literal["oip", "generate", "openai"]
MODEL_PREFIX = "/v2/models/"
"""Where every per-model path starts: the segment after it is the deployment (the model)."""
_VERSIONED = "{model}[/versions/{version}]"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference endpoint (see the module docstring)."""

    name: str
    method: str | None
    """HTTP method; None for a gRPC-only endpoint (a stream of inferences)."""
    path: str | None
    operation: str
    """The DataPlane method (``serving/dataplane.py``) that answers it."""
    grpc: str | None = None
    open: bool = False
    gateway: GatewayRole = "forward"
    api: Api = "oip"

    @property
    def per_model(self) -> bool:
        """Whether the path names the deployment (``{model}``)."""
        return self.path is not None and "{model}" in self.path

    @property
    def action(self) -> str:
        """A per-model path's part after the model (and its version): "" for the model itself."""
        assert self.path is not None and self.per_model
        return self.path.split(_VERSIONED, 1)[1].lstrip("/")


def _model(action: str, operation: str, grpc: str | None, gateway: GatewayRole = "forward") -> Endpoint:
    """A per-model OIP row: ``GET /v2/models/{model}[/versions/{version}][/<action>]`` (POST for inference)."""
    path = f"{MODEL_PREFIX}{_VERSIONED}" + (f"/{action}" if action else "")
    if action == "infer":
        return Endpoint(action, "POST", path, operation, grpc, gateway=gateway)
    return Endpoint(f"model_{action or 'metadata'}", "GET", path, operation, grpc, gateway=gateway)


def _repository(name: str, path: str, operation: str, grpc: str) -> Endpoint:
    """A row of the repository extension: a replica's own, never through the gateway."""
    return Endpoint(name, "POST", f"/v2/repository/{path}", operation, grpc, gateway="none")


def _generate(action: str) -> Endpoint:
    """Triton's generate extension, on the per-model path: the generative front's."""
    path = f"{MODEL_PREFIX}{_VERSIONED}/{action}"
    return Endpoint(action, "POST", path, "generative", gateway="stream", api="generate")


def _openai(name: str, method: str, path: str, operation: str, gateway: GatewayRole = "stream") -> Endpoint:
    """OpenAI's API: the model is named in the body, not the path."""
    return Endpoint(name, method, f"/v1/{path}", operation, gateway=gateway, api="openai")


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("health_live", "GET", "/v2/health/live", "live", "ServerLive", open=True, gateway="answer"),
    Endpoint("health_ready", "GET", "/v2/health/ready", "server_ready", "ServerReady", open=True, gateway="answer"),
    Endpoint("server_metadata", "GET", "/v2", "server_metadata", "ServerMetadata", gateway="answer"),
    _model("", "model_metadata", "ModelMetadata"),
    _model("ready", "model_ready", "ModelReady"),
    _model("config", "model_config", "ModelConfig"),
    _model("stats", "model_statistics", "ModelStatistics", gateway="fan_out"),
    _model("infer", "infer", "ModelInfer"),
    Endpoint("statistics", "GET", "/v2/models/stats", "model_statistics", gateway="none"),
    Endpoint("stream_infer", None, None, "infer", "ModelStreamInfer", gateway="none"),
    _repository("repository_index", "index", "repository_index", "RepositoryIndex"),
    _repository("repository_load", "models/{name}/load", "load", "RepositoryModelLoad"),
    _repository("repository_unload", "models/{name}/unload", "unload", "RepositoryModelUnload"),
    _generate("generate"),
    _generate("generate_stream"),
    _openai("models", "GET", "models", "repository", gateway="answer"),
    _openai("chat", "POST", "chat/completions", "generative"),
    _openai("completion", "POST", "completions", "generative"),
    _openai("embedding", "POST", "embeddings", "embed"),
)
BY_NAME = {e.name: e for e in ENDPOINTS}
GRPC_METHODS = frozenset(e.grpc for e in ENDPOINTS if e.grpc)
"""The methods of Triton's service that a replica serves (the others answer UNIMPLEMENTED)."""
OPEN_HTTP_PATHS = frozenset(e.path for e in ENDPOINTS if e.open and e.path)
GRPC_SERVICE = "inference.GRPCInferenceService"
OPEN_GRPC_METHODS = frozenset(f"/{GRPC_SERVICE}/{e.grpc}" for e in ENDPOINTS if e.open and e.grpc)


@dataclass(frozen=True, slots=True)
class Match:
    """A request's endpoint, with the model and version its path names ("" where it names none)."""

    endpoint: Endpoint
    model: str = ""
    version: str = ""


_PER_MODEL: dict[tuple[str | None, str | None], Endpoint] = {
    (e.method, e.action): e for e in ENDPOINTS if e.per_model and e.api == "oip"
}
_OTHER_OIP = [(e, e.path.strip("/").split("/")) for e in ENDPOINTS if e.path and not e.per_model and e.api == "oip"]
_OPENAI = {(e.method.encode(), e.path): e for e in ENDPOINTS if e.api == "openai" and e.method and e.path}
_GENERATE = tuple(e for e in ENDPOINTS if e.api == "generate")
_GENERATE_SUFFIXES = tuple(f"/{e.action}" for e in _GENERATE)


def oip_match(method: str, parts: list[str]) -> Match | None:
    """The OIP endpoint of a request (its path split on ``/``, the slashes at its ends stripped), else None.
    A per-model path is ``v2/models/<m>[/versions/<v>][/<action>]`` with ``<m>`` not ``stats``."""
    if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models" and parts[2] != "stats":
        name, version, action = model_route(parts)
        row = _PER_MODEL.get((method, action))
        return None if row is None else Match(row, name, version)
    for row, pattern in _OTHER_OIP:
        if row.method == method and len(pattern) == len(parts):
            named = ""
            for want, got in zip(pattern, parts, strict=True):
                if want.startswith("{"):
                    named = got
                elif want != got:
                    break
            else:
                return Match(row, named)
    return None


def model_route(parts: list[str]) -> tuple[str, str, str | None]:
    """``v2/models/<m>[/versions/<v>][/<action>]`` split: model, version ("" for the latest), action ("" for the
    model itself; None for a path of more parts)."""
    name = parts[2]
    version, rest = "", parts[3:]
    if len(rest) >= 2 and rest[0] == "versions":
        version, rest = rest[1], rest[2:]
    action = rest[0] if len(rest) == 1 else ("" if not rest else None)
    return name, version, action


def generative_match(method: bytes, path: str) -> Endpoint | None:
    """The generative endpoint (OpenAI's API, Triton's generate extension) a request is for, else None. A path
    under ``/v2/models/`` that ends in ``/generate`` or ``/generate_stream`` is one (a malformed one is
    answered 404 in the generate extension's error shape)."""
    if path.startswith("/v1/"):
        return _OPENAI.get((method, path))
    if method == b"POST" and path.startswith(MODEL_PREFIX) and path.endswith(_GENERATE_SUFFIXES):
        return BY_NAME[path.rsplit("/", 1)[1]]
    return None


_ANSWERED = {e.path: e for e in ENDPOINTS if e.gateway == "answer" and e.api == "oip" and e.path}
_ANSWERED["/v2/"] = BY_NAME["server_metadata"]  # as a replica, which strips a path's slashes, answers it
_FAN_OUT = tuple(
    ((e.method, e.method.encode()), f"/{e.action}")
    for e in ENDPOINTS
    if e.gateway == "fan_out" and e.per_model and e.method
)
"""Each fanned-out row's method (as text and as the HTTP/1.1 server's bytes) and the end of its path."""


def gateway_answer(path: str) -> Endpoint | None:
    """The OIP row the gateway answers itself at ``path`` (whatever the method: health, server metadata)."""
    return _ANSWERED.get(path)


def gateway_role(method: str | bytes, path: str) -> GatewayRole | None:
    """What the gateway does with a per-model path: ``fan_out`` (statistics), else ``forward`` (any other path
    under ``/v2/models/``, also one no row names: the replica answers it); None for a path that is not per-model.
    The generative rows are :func:`generative_match`'s, asked first."""
    if not path.startswith(MODEL_PREFIX):
        return None
    for methods, end in _FAN_OUT:
        if method in methods and path.endswith(end):
            return "fan_out"
    return "forward"


def deployment_of(path: str) -> str:
    """The deployment a per-model path names (its segment after ``/v2/models/``)."""
    return path[len(MODEL_PREFIX) :].split("/", 1)[0]


__all__ = [
    "BY_NAME",
    "ENDPOINTS",
    "GRPC_METHODS",
    "GRPC_SERVICE",
    "MODEL_PREFIX",
    "OPEN_GRPC_METHODS",
    "OPEN_HTTP_PATHS",
    "Endpoint",
    "Match",
    "deployment_of",
    "gateway_answer",
    "gateway_role",
    "generative_match",
    "model_route",
    "oip_match",
]
