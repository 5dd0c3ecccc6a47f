"""Kubernetes: pods of an InferenceDeployment with ``modelStorage`` read their model through their node's cache
(a hostPath every pod on the node shares, as KServe's LocalModelCache keeps models on the node): the operator's
objects are valid Kubernetes, the CRD takes the fields, and a bad spec names the field."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.k8s.operator import NODE_CACHE_HOST_PATH, deployment_for, owner_reference, parse
from tests.k8s.test_manifests import crd_schema, k8s_validate


def cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "octacloud.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bert", "namespace": "ml", "uid": "u-1"},
        "spec": {"model": "bert", "octants": 4, **spec},
    }


def test_pods_fetch_through_the_node_cache() -> None:
    obj = cr(modelStorage="s3://models/prod", storageSecret="s3-creds", cacheSize="200GiB", version="2")
    jsonschema.validate(obj, crd_schema())
    d = deployment_for(parse(obj, None, None), owner_reference(obj))
    k8s_validate(d)
    pod = d["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    flags = dict(zip(command[2::2], command[3::2], strict=False))
    assert flags["--model-storage"] == "s3://models/prod" and flags["--fetch-model"] == "bert"
    assert flags["--fetch-version"] == "2" and flags["--model-cache-size"] == "200GiB"
    assert flags["--storage-credentials"] == "/etc/octacloud/storage/credentials"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["hostPath"] == {"path": NODE_CACHE_HOST_PATH, "type": "DirectoryOrCreate"}
    assert volumes["storage-credentials"]["secret"] == {"secretName": "s3-creds"}
    assert "models" not in volumes  # no PVC: the store is read through the node cache
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["model-cache"] == flags["--model-cache"]


def test_without_a_store_pods_read_the_claim_in_place() -> None:
    d = deployment_for(parse(cr(), None, None), owner_reference(cr()))
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert set(volumes) == {"models"} and "persistentVolumeClaim" in volumes["models"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"storageSecret": "s"}, "go with spec.modelStorage"),
        ({"modelStorage": "s3://m/p", "cacheSize": "lots"}, r"spec.cacheSize: 'lots' is not a size"),
        ({"modelStorage": 7}, "spec.modelStorage must be a string"),
    ],
)
def test_a_bad_storage_spec_names_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse(cr(**spec), None, None)
