"""deploy/k8s against the Kubernetes schemas (kubernetes-validate's offline OpenAPI schemas, strict), the CRD's own
schema, and kube-scheduler's configuration types; the operator's objects and the wire fixtures too."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from octacloud.core.model import Gpu, Node
from octacloud.k8s.operator import deployment_for, owner_reference, parse, service_for

from .wire import node_obj, pod

DEPLOY = Path(__file__).parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.33"
NOT_API_KINDS = {"KubeSchedulerConfiguration", "InferenceDeployment"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("config/*.yaml"), *DEPLOY.glob("examples/*.yaml")]):
        for k, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.relative_to(DEPLOY)}#{k}", doc))
    return out


def k8s_validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("where", "doc"), [d for d in documents() if d[1]["kind"] not in NOT_API_KINDS])
def test_manifest_is_valid_kubernetes(where: str, doc: dict[str, Any]) -> None:
    k8s_validate(doc)


def test_the_validator_rejects_what_kubernetes_would() -> None:
    (_, ds) = next(d for d in documents() if d[1]["kind"] == "DaemonSet")
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(bad)
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # misspelt: strict schemas refuse it
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(bad)


def crd_schema() -> dict[str, Any]:
    (_, crd) = next(d for d in documents() if d[1]["kind"] == "CustomResourceDefinition")
    (version,) = crd["spec"]["versions"]

    def convert(s: Any) -> Any:  # structural schema → JSON Schema
        if isinstance(s, dict):
            s = {k: convert(v) for k, v in s.items() if not k.startswith("x-kubernetes-preserve")}
            if s.pop("x-kubernetes-int-or-string", False):
                s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if s.get("type") == "object" and "properties" in s and "status" not in s["properties"]:
                s.setdefault("additionalProperties", False)
            return s
        return [convert(v) for v in s] if isinstance(s, list) else s

    schema = convert(version["schema"]["openAPIV3Schema"])
    schema["properties"].update({"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {}})
    return dict(schema)


def test_examples_match_the_crd_and_the_operator_accepts_them() -> None:
    schema = crd_schema()
    examples = [d for _, d in documents() if d["kind"] == "InferenceDeployment"]
    assert examples
    for ex in examples:
        jsonschema.validate(ex, schema)
    parse(examples[0], None, None)  # the fixed-size one needs no repository
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**examples[0], "spec": {"model": "m", "replica": 2}}, schema)


def test_operator_objects_are_valid_kubernetes() -> None:
    cr = {"metadata": {"name": "bert", "namespace": "ml", "uid": "u-1"}, "spec": {"model": "bert", "octants": 4}}
    d = parse(cr, None, None)
    k8s_validate(deployment_for(d, owner_reference(cr)))
    k8s_validate(service_for(d, owner_reference(cr)))


def test_wire_fixtures_are_valid_kubernetes() -> None:
    k8s_validate(pod("p", 3, annotations={"octacloud.io/gpu-memory-mib": "2048"}))
    k8s_validate(node_obj(Node("n", 8_000, 65_536, (Gpu(0, "A100", 81_920, 0), Gpu(1, "A100", 81_920, 0)))))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p", "namespace": "default", "uid": "u"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n"},
    }
    k8s_validate(binding)


# kube-scheduler's configuration (k8s.io/kube-scheduler/config/v1): the Extender fields and their JSON names.
EXTENDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["urlPrefix"],
    "properties": {
        "urlPrefix": {"type": "string", "pattern": "^https?://"},
        "filterVerb": {"type": "string"},
        "preemptVerb": {"type": "string"},
        "prioritizeVerb": {"type": "string"},
        "weight": {"type": "integer", "minimum": 1},
        "bindVerb": {"type": "string"},
        "enableHTTPS": {"type": "boolean"},
        "tlsConfig": {"type": "object"},
        "httpTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m)$"},
        "nodeCacheCapable": {"type": "boolean"},
        "managedResources": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "ignoredByScheduler": {"type": "boolean"}},
            },
        },
        "ignorable": {"type": "boolean"},
    },
}
CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind"],
    "properties": {
        "apiVersion": {"const": "kubescheduler.config.k8s.io/v1"},
        "kind": {"const": "KubeSchedulerConfiguration"},
        "parallelism": {"type": "integer"},
        "leaderElection": {"type": "object"},
        "clientConnection": {"type": "object"},
        "percentageOfNodesToScore": {"type": "integer"},
        "podInitialBackoffSeconds": {"type": "integer"},
        "podMaxBackoffSeconds": {"type": "integer"},
        "profiles": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "schedulerName": {"type": "string"},
                    "percentageOfNodesToScore": {"type": "integer"},
                    "plugins": {"type": "object"},
                    "pluginConfig": {"type": "array"},
                },
            },
        },
        "extenders": {"type": "array", "items": EXTENDER_SCHEMA},
        "delayCacheUntilActive": {"type": "boolean"},
    },
}


def test_scheduler_configuration_calls_the_extender_as_it_serves() -> None:
    config = yaml.safe_load((DEPLOY / "config" / "scheduler-config.yaml").read_text())
    jsonschema.validate(config, CONFIG_SCHEMA)
    (ext,) = config["extenders"]
    assert ext["nodeCacheCapable"] is True and ext["bindVerb"] == "bind"
    assert {r["name"] for r in ext["managedResources"]} == {"octacloud.io/octants", "octacloud.io/gpus"}
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["preemptVerb"]) == ("filter", "prioritize", "preempt")
    (cm,) = [d for _, d in documents() if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(cm["data"]["scheduler-config.yaml"]) == config
    (sched,) = [
        d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "octacloud-scheduler"
    ]
    extender = next(c for c in sched["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")
    port = extender["command"][extender["command"].index("--port") + 1]
    assert ext["urlPrefix"] == f"http://127.0.0.1:{port}"
    assert config["profiles"][0]["schedulerName"] == "octacloud"
    cr = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": {"model": "m"}}
    template = deployment_for(parse(cr, None, None), owner_reference(cr))["spec"]["template"]["spec"]
    assert template["schedulerName"] == "octacloud"  # the operator's pods go through that profile


def test_scheduler_configuration_schema_catches_typos() -> None:
    config = yaml.safe_load((DEPLOY / "config" / "scheduler-config.yaml").read_text())
    config["extenders"][0]["nodeCacheCapeable"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, CONFIG_SCHEMA)
