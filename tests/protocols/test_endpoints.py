"""The one table of inference endpoints (protocols/endpoints.py): how a path is matched, and that every front
serves exactly the rows that are its own."""

from __future__ import annotations

import pytest

from octacloud.protocols.endpoints import (
    BY_NAME,
    ENDPOINTS,
    OPEN_GRPC_METHODS,
    OPEN_HTTP_PATHS,
    generative_match,
    oip_match,
)
from octacloud.protocols.openai import schema
from octacloud.protocols.rest.app import RestApp


def _split(path: str) -> list[str]:
    return path.strip("/").split("/")


@pytest.mark.parametrize(
    ("method", "path", "name", "model", "version"),
    [
        ("GET", "/v2/health/live", "health_live", "", ""),
        ("GET", "/v2/health/ready", "health_ready", "", ""),
        ("GET", "/v2", "server_metadata", "", ""),
        ("GET", "/v2/", "server_metadata", "", ""),
        ("GET", "/v2/models/m", "model_metadata", "m", ""),
        ("GET", "/v2/models/m/versions/3", "model_metadata", "m", "3"),
        ("GET", "/v2/models/m/ready", "model_ready", "m", ""),
        ("GET", "/v2/models/m/versions/3/ready", "model_ready", "m", "3"),
        ("GET", "/v2/models/m/config", "model_config", "m", ""),
        ("GET", "/v2/models/m/stats", "model_stats", "m", ""),
        ("GET", "/v2/models/stats", "statistics", "", ""),
        ("POST", "/v2/models/m/infer", "infer", "m", ""),
        ("POST", "/v2/models/m/versions/2/infer", "infer", "m", "2"),
        ("POST", "/v2/repository/index", "repository_index", "", ""),
        ("POST", "/v2/repository/models/m/load", "repository_load", "m", ""),
        ("POST", "/v2/repository/models/m/unload", "repository_unload", "m", ""),
    ],
)
def test_an_oip_path_matches_its_row(method: str, path: str, name: str, model: str, version: str) -> None:
    found = oip_match(method, _split(path))
    assert found is not None
    assert (found.endpoint.name, found.model, found.version) == (name, model, version)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/m/infer"),  # the wrong method
        ("POST", "/v2/models/m"),
        ("PUT", "/v2/models/m/infer"),
        ("GET", "/v2/repository/index"),
        ("GET", "/v2/models/m/versions"),  # malformed: a version without its number
        ("GET", "/v2/models/m/versions/1/ready/more"),
        ("GET", "/v2/models/stats/ready"),  # "stats" is all models' statistics, not a model
        ("GET", "/v2/models"),
        ("GET", "/v2/health/dead"),
        ("POST", "/v2/repository/models/m/reload"),
        ("GET", "/v1/models"),  # OpenAI's API is the generative front's, not OIP's
    ],
)
def test_other_paths_and_methods_match_no_oip_row(method: str, path: str) -> None:
    assert oip_match(method, _split(path)) is None


def test_generative_rows_are_openai_paths_and_the_generate_extension() -> None:
    assert {path: generative_match(b"POST", path).name for path in schema.PATHS} == schema.PATHS  # type: ignore[union-attr]
    assert generative_match(b"GET", "/v1/models") is BY_NAME["models"]
    assert generative_match(b"GET", "/v1/chat/completions") is None
    assert generative_match(b"POST", "/v1/nothing") is None
    assert generative_match(b"POST", "/v2/models/m/generate") is BY_NAME["generate"]
    assert generative_match(b"POST", "/v2/models/m/versions/1/generate_stream") is BY_NAME["generate_stream"]
    assert generative_match(b"GET", "/v2/models/m/generate") is None
    assert generative_match(b"POST", "/v2/models/m/infer") is None


def test_the_open_endpoints_are_health_alone() -> None:
    assert {"/v2/health/live", "/v2/health/ready"} == OPEN_HTTP_PATHS
    assert {
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    } == OPEN_GRPC_METHODS


def test_the_replica_rest_app_answers_every_oip_row_and_no_other() -> None:
    served = set(RestApp(None)._answers)  # type: ignore[arg-type]
    assert served == {e.name for e in ENDPOINTS if e.api == "oip" and e.path}


def test_names_are_unique_and_every_operation_is_the_dataplanes() -> None:
    from octacloud.serving import DataPlane

    assert len(BY_NAME) == len(ENDPOINTS)
    dataplane = DataPlane(None)  # type: ignore[arg-type]
    missing = [e.name for e in ENDPOINTS if not hasattr(dataplane, e.operation)]
    assert not missing, f"rows naming no DataPlane method: {missing}"


def test_every_grpc_method_of_the_table_is_in_the_proto_and_the_servicer_serves_exactly_those() -> None:
    from tritonclient.grpc import service_pb2 as pb

    from octacloud.protocols.endpoints import GRPC_METHODS, GRPC_SERVICE
    from octacloud.protocols.grpc.servicer import InferenceServicer

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == GRPC_SERVICE
    in_proto = {m.name for m in service.methods}
    assert in_proto >= GRPC_METHODS, f"not in Triton's service: {sorted(GRPC_METHODS - in_proto)}"
    served = {name for name in vars(InferenceServicer) if name[0].isupper() and callable(vars(InferenceServicer)[name])}
    assert served == GRPC_METHODS, f"served but not in the table: {sorted(served - GRPC_METHODS)}; " + (
        f"in the table but not served: {sorted(GRPC_METHODS - served)}"
    )


def test_the_gateways_grpc_front_offers_the_rows_it_forwards_or_answers() -> None:
    from octacloud.gateway.grpc_proxy import GrpcGateway
    from octacloud.gateway.routing import RouteTable
    from octacloud.protocols.endpoints import GRPC_SERVICE

    offered = set(GrpcGateway(RouteTable()).methods())
    assert offered == {f"/{GRPC_SERVICE}/{e.grpc}" for e in ENDPOINTS if e.grpc and e.gateway != "none"}


@pytest.mark.parametrize(
    ("method", "path", "role"),
    [
        ("POST", "/v2/models/m/infer", "forward"),
        ("GET", "/v2/models/m/versions/2/ready", "forward"),
        ("GET", "/v2/models/m/nothing", "forward"),  # the replica answers what no row names
        ("GET", "/v2/models/m/stats", "fan_out"),
        ("GET", "/v2/models/m/versions/1/stats", "fan_out"),
        ("POST", "/v2/models/m/stats", "forward"),
        ("GET", "/v2/models", None),
        ("GET", "/v2/health/live", None),
        ("POST", "/v2/repository/index", None),
        ("POST", "/admin/deployments", None),
    ],
)
def test_the_gateway_role_of_a_path(method: str, path: str, role: str | None) -> None:
    from octacloud.protocols.endpoints import gateway_role

    assert gateway_role(method, path) == role


def test_the_gateway_answers_the_rows_it_answers_itself() -> None:
    from octacloud.gateway.rest import RestGateway
    from octacloud.gateway.routing import RouteTable
    from octacloud.protocols.endpoints import gateway_answer

    answered = {e.name for e in ENDPOINTS if e.gateway == "answer" and e.api == "oip"}
    assert set(RestGateway(RouteTable())._answers) == answered
    assert [gateway_answer(p).name for p in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/")] == [  # type: ignore[union-attr]
        "health_live",
        "health_ready",
        "server_metadata",
        "server_metadata",
    ]
    assert gateway_answer("/v2/health/live/") is None
    assert gateway_answer("/v2/models/m") is None


@pytest.mark.parametrize(
    ("path", "target"),
    [
        ("/v2/models/m/infer", ("m", "")),
        ("/v2/models/m/versions/2/infer", ("m", "2")),
        ("/v2/models/infer", None),  # the model "infer" itself
        ("/v2/models/stats/infer", None),
        ("/v2/models/m/versions/infer", None),
        ("/v2/models/m/x/infer", None),
        ("/v1/models/m/infer", None),
    ],
)
def test_the_replicas_inference_fast_path_is_the_infer_row(path: str, target: tuple[str, str] | None) -> None:
    from octacloud.protocols.rest.app import infer_target

    assert infer_target(path) == target
