"""What a deploy request resolves to: the defaults for a new deployment, the operator's settings for a redeploy."""

from __future__ import annotations

import pytest

from octacloud.control.deploy_request import DEFAULT_MAX_REPLICAS, DeployRequest, compare, resolve, summary
from octacloud.control.deployments import Deployment, DeploymentSpec
from octacloud.core import InvalidSpecError


def test_a_new_deployment_gets_the_defaults() -> None:
    spec = resolve(DeployRequest({"name": "mlp", "model": "mlp"}), None)
    assert (spec.octants, spec.min_replicas, spec.max_replicas, spec.version) == (None, 1, DEFAULT_MAX_REPLICAS, "")
    assert resolve(DeployRequest({"name": "mlp", "model": "mlp", "min_replicas": 6}), None).max_replicas == 6
    with pytest.raises(InvalidSpecError, match="is new: name its model"):
        resolve(DeployRequest({"name": "mlp"}), None)


def test_a_redeploy_keeps_what_it_does_not_name() -> None:
    before = DeploymentSpec("mlp", "mlp", octants=2, min_replicas=1, max_replicas=4, target_qps=None)
    request = DeployRequest({"name": "mlp", "model": "mlp_fp16"})
    spec = resolve(request, before)
    assert (spec.model, spec.octants, spec.min_replicas, spec.max_replicas) == ("mlp_fp16", 2, 1, 4)
    changes, kept = compare(request, Deployment(before, 2, 2), Deployment(spec, 2, 2))
    assert changes == {"model": ["mlp", "mlp_fp16"]}
    assert kept == {"version": "", "octants": 2, "min_replicas": 1, "max_replicas": 4, "target_qps": None,
                    "slo_ms": None, "published": False, "spread": "soft", "replicas": 2}  # fmt: skip
    text = summary(changes, kept)
    assert text.startswith("keeps version latest, octants 2, min_replicas 1, max_replicas 4") and "2 replica(s)" in text
    assert text.endswith("changes model mlp → mlp_fp16")


def test_a_bound_moved_past_the_kept_one_takes_it_along() -> None:
    before = DeploymentSpec("mlp", "mlp", min_replicas=1, max_replicas=4)
    assert resolve(DeployRequest({"name": "mlp", "min_replicas": 6}), before).max_replicas == 6
    assert resolve(DeployRequest({"name": "mlp", "max_replicas": 0}), before).min_replicas == 0
    with pytest.raises(InvalidSpecError, match="min_replicas <= max_replicas"):
        resolve(DeployRequest({"name": "mlp", "min_replicas": 6, "max_replicas": 2}), before)


def test_null_sets_auto_and_unknown_fields_are_named() -> None:
    before = DeploymentSpec("mlp", "mlp", octants=2)
    assert resolve(DeployRequest({"name": "mlp", "octants": None}), before).octants is None
    with pytest.raises(InvalidSpecError, match=r"unknown deployment field\(s\) \['gpus'\]"):
        DeployRequest({"name": "mlp", "gpus": 1})
    with pytest.raises(InvalidSpecError, match="octants must be a whole number"):
        resolve(DeployRequest({"name": "mlp", "octants": 1.5}), before)
