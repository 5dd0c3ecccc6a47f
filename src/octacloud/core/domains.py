"""Failure domains: the zone, rack and power feed a node shares with others, read from its labels.

A node's domains are labels, so that every source of nodes carries them the same way: the fleet file's ``zone``,
``rack`` and ``power_feed`` keys write :data:`ZONE_LABEL`, :data:`RACK_LABEL` and :data:`POWER_FEED_LABEL`; a
Kubernetes node's well-known ``topology.kubernetes.io/zone`` (and the common ``topology.kubernetes.io/rack``)
are read as well; a Ray node carries the octacloud labels (or, on a cluster started without labels, marker
resources ``octacloud_rack:<name>``, see ``control/ray/inventory.py``).

Every node is also a domain of its own (kind ``node``). A node whose label for a kind is missing forms a domain
of that kind alone (its name is the node's, prefixed ``~``): a rack nobody declared is not shared with anyone.
Domain names are fleet-wide: two racks called ``r1`` in two zones are one rack; name them ``a-r1`` and ``b-r1``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node

ZONE_LABEL = "octacloud.io/zone"
RACK_LABEL = "octacloud.io/rack"
POWER_FEED_LABEL = "octacloud.io/power-feed"

DOMAIN_KINDS: tuple[str, ...] = ("node", "rack", "power_feed", "zone")
"""Kinds of failure domain, smallest first."""
DECLARED_KINDS: tuple[str, ...] = ("zone", "rack", "power_feed")
"""The kinds a fleet declares (``node`` is implied)."""

DOMAIN_LABELS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "zone": (ZONE_LABEL, "topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone"),
        "rack": (RACK_LABEL, "topology.kubernetes.io/rack"),
        "power_feed": (POWER_FEED_LABEL,),
    }
)
"""Per declared kind, the labels read for it, first found wins (octacloud's own, then Kubernetes' well-known)."""

UNDECLARED_PREFIX = "~"
"""Prefix of the domain a node forms alone when it declares none of a kind."""

_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def check_domain_name(kind: str, value: str, where: str) -> str:
    """``value`` as a domain name of ``kind``, or :class:`InvalidSpecError` naming ``where`` (valid as a
    Kubernetes and a Ray label value: 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or
    digit)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidSpecError(
            f"{where}: {kind} {value!r} must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit"
        )
    return value


@dataclass(frozen=True, slots=True)
class FailureDomains:
    """Where a node sits: its zone, rack and power feed ('' where it declares none)."""

    zone: str = ""
    rack: str = ""
    power_feed: str = ""

    def label(self) -> str:
        """``zone/rack/feed`` for tables, '-' for a part not declared."""
        return "/".join(part or "-" for part in (self.zone, self.rack, self.power_feed))


def declared(node: Node, kind: str) -> str:
    """The name of ``node``'s domain of declared ``kind`` from its labels ('' when it declares none)."""
    try:
        labels = DOMAIN_LABELS[kind]
    except KeyError:
        raise InvalidSpecError(f"unknown failure-domain kind {kind!r}; known: {list(DECLARED_KINDS)}") from None
    for label in labels:
        value = node.labels.get(label)
        if value:
            return value
    return ""


def domains_of(node: Node) -> FailureDomains:
    """The zone, rack and power feed ``node`` declares."""
    return FailureDomains(declared(node, "zone"), declared(node, "rack"), declared(node, "power_feed"))


def domain_dict(node: Node) -> dict[str, str]:
    """``{"zone": ..., "rack": ..., "power_feed": ...}`` as ``node`` declares them ('' where it does not), for
    JSON answers."""
    d = domains_of(node)
    return {"zone": d.zone, "rack": d.rack, "power_feed": d.power_feed}


def domain_of(node: Node, kind: str) -> str:
    """The domain of ``kind`` ``node`` belongs to: its name for ``node``, the declared name, or ``~<node>``."""
    if kind == "node":
        return node.name
    return declared(node, kind) or UNDECLARED_PREFIX + node.name


def group_by_domain(nodes: Sequence[Node], kind: str) -> dict[str, list[int]]:
    """Domain name → indices of its nodes (in ``nodes`` order), domains in order of their first node."""
    if kind not in DOMAIN_KINDS:
        raise InvalidSpecError(f"unknown failure-domain kind {kind!r}; known: {list(DOMAIN_KINDS)}")
    groups: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        groups.setdefault(domain_of(node, kind), []).append(i)
    return groups


def domain_labels(zone: str = "", rack: str = "", power_feed: str = "") -> dict[str, str]:
    """The labels that declare these domains (empty parts left out)."""
    out: dict[str, str] = {}
    for label, value in ((ZONE_LABEL, zone), (RACK_LABEL, rack), (POWER_FEED_LABEL, power_feed)):
        if value:
            out[label] = value
    return out
