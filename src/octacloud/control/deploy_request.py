"""What a deploy asks for: the one set of defaults for ``octacloud deploy``, ``POST /admin/deployments`` and
``octacloud up --deploy``, and what a redeploy keeps.

A :class:`DeployRequest` holds only the fields its caller set. For a new deployment the others take
:data:`DEFAULTS`: octants sized automatically, 1..4 replicas (:data:`DEFAULT_MAX_REPLICAS`, at least
``min_replicas``), no target load, the latest version, unpublished. For an existing one they keep what the
operator set before (model, version, octants, min/max, target, priority, publication, spread): re-running ``deploy``
with a new model rolls it out at the same size and count, and says what it kept (:func:`compare`). A field sent
as ``null`` (``octants``: auto, ``target_qps``/``slo_ms``: none) sets that value; it is not "unset".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from octacloud.control.deployments import Deployment, DeploymentSpec
from octacloud.core import fields
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import SPREAD_SOFT

DEFAULT_MAX_REPLICAS = 4
"""The most replicas ``scale`` and the autoscaler may take a new deployment to, unless it says otherwise."""

SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(DeploymentSpec))

DEFAULTS: Mapping[str, Any] = {
    "version": "",
    "octants": None,
    "min_replicas": 1,
    "target_qps": None,
    "slo_ms": None,
    "priority": 0,
    "priority_class": "",
    "tenant": "default",
    "published": False,
    "spread": SPREAD_SOFT,
}
"""A new deployment's fields that its request leaves out (``max_replicas``: :data:`DEFAULT_MAX_REPLICAS`, or
``min_replicas`` when that is more)."""

KEPT = ("model", "version", "octants", "min_replicas", "max_replicas", "target_qps", "slo_ms", "published", "spread")
"""What a redeploy reports as kept when its request leaves it out (and the replica count, always)."""


@dataclass(frozen=True, slots=True)
class DeployRequest:
    """The fields of a deploy that its caller set, by :class:`DeploymentSpec` field name (``name`` required)."""

    given: Mapping[str, Any]

    def __post_init__(self) -> None:
        unknown = sorted(set(self.given) - set(SPEC_FIELDS), key=str)
        if unknown:
            raise InvalidSpecError(
                f"unknown deployment field(s) [{', '.join(fields.shown(u) for u in unknown)}]; "
                f"allowed: {list(SPEC_FIELDS)}"
            )
        if "name" not in self.given:
            raise InvalidSpecError("a deployment needs a name")

    @property
    def name(self) -> str:
        return str(self.given["name"])

    @classmethod
    def of(cls, spec: DeploymentSpec) -> DeployRequest:
        """A request that sets every field of ``spec`` (it replaces the deployment's spec as a whole)."""
        return cls(dataclasses.asdict(spec))


def resolve(request: DeployRequest, existing: DeploymentSpec | None) -> DeploymentSpec:
    """The spec ``request`` asks for: its fields over ``existing``'s (a redeploy) or over :data:`DEFAULTS` (a new
    deployment). Raises :class:`InvalidSpecError` naming a field of the wrong type or out of range."""
    given = dict(request.given)
    if existing is None:
        if "model" not in given:
            raise InvalidSpecError(f"deployment {request.name!r} is new: name its model")
        merged = {**DEFAULTS, **given}
        low = merged["min_replicas"]
        if "max_replicas" not in given and isinstance(low, int) and not isinstance(low, bool):
            merged["max_replicas"] = max(DEFAULT_MAX_REPLICAS, low)
        merged.setdefault("max_replicas", DEFAULT_MAX_REPLICAS)
    else:
        merged = {**dataclasses.asdict(existing), **given}
        low, high = merged["min_replicas"], merged["max_replicas"]
        if _whole(low) and _whole(high) and low > high:  # one bound moved past the other, which was kept
            if "max_replicas" not in given:
                merged["max_replicas"] = low
            elif "min_replicas" not in given:
                merged["min_replicas"] = high
    return DeploymentSpec(**merged)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def compare(request: DeployRequest, old: Deployment | None, new: Deployment) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(changes, kept)`` of a deploy: each field that changed as ``[before, after]`` (the replica count and the
    resolved octants included), and what a redeploy kept of what the operator had set. A new deployment changes
    nothing and keeps nothing."""
    if old is None:
        return {}, {}
    before, after = dataclasses.asdict(old.spec), dataclasses.asdict(new.spec)
    changes: dict[str, Any] = {k: [before[k], after[k]] for k in SPEC_FIELDS if before[k] != after[k]}
    if old.octants != new.octants:
        changes["octants"] = [old.octants, new.octants]
    if old.replicas != new.replicas:
        changes["replicas"] = [old.replicas, new.replicas]
    kept: dict[str, Any] = {k: after[k] for k in KEPT if k not in request.given and k not in changes}
    if "replicas" not in changes:
        kept["replicas"] = new.replicas
    if "octants" in kept and kept["octants"] is None:
        kept["octants"] = f"auto ({new.octants})"
    return changes, kept


def summary(changes: Mapping[str, Any], kept: Mapping[str, Any]) -> str:
    """``compare``'s answer in words, for events and the CLI: "keeps 2 replica(s), ...; changes model a → b"."""
    parts = []
    if kept:
        parts.append("keeps " + ", ".join(_kept(k, v) for k, v in kept.items()))
    if changes:
        parts.append("changes " + ", ".join(f"{k} {_show(k, a)} → {_show(k, b)}" for k, (a, b) in changes.items()))
    return "; ".join(parts) or "nothing changes"


def _kept(field: str, value: Any) -> str:
    return f"{value} replica(s)" if field == "replicas" else f"{field} {_show(field, value)}"


def _show(field: str, value: Any) -> str:
    if value is None:
        return "auto" if field == "octants" else "none"
    if value == "":
        return "latest" if field == "version" else "none"
    return str(value)
