"""Failure domains for simulated fleets: a seeded generator of racks, power feeds and zones.

The openb fleet has no racks. :func:`assign_domains` gives it some the way a data centre is built: servers are
bought and cabled per kind, so a rack holds nodes of one kind (GPU model, cards, CPU, memory), as many as fit its
GPU slots (``rack_gpus``, at least one node) and at most ``rack_nodes``; the nodes of a kind are dealt to racks in
a seeded order, so which nodes share a rack is drawn with the seed. Racks are numbered in a seeded order too, and
``feed_racks`` consecutive racks share a power feed; racks are dealt round-robin to ``zones`` zones.

A node file may carry the domains itself (optional columns ``zone``, ``rack``, ``power_feed``; see
:mod:`octacloud.sim.traces`): :func:`write_domain_nodes` writes one, and ``octacloud simulate generate racks``
is the command.

Spec strings (``--racks``): comma-separated ``rack_gpus=32``, ``rack_nodes=16``, ``feed_racks=2``,
``zones=3``; any left out keeps its default. Everything is a pure function of its inputs and seed.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from octacloud.core.domains import domain_labels, domains_of
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node
from octacloud.sim.generate import NODE_HEADER
from octacloud.sim.traces import DOMAIN_COLUMNS


@dataclass(frozen=True, slots=True)
class DomainSpec:
    """How nodes are grouped into racks, racks onto power feeds and into zones."""

    rack_gpus: int = 32
    """GPU slots of a rack: four 8-card servers (about 26 kW at 6.5 kW each), sixteen 2-card ones."""
    rack_nodes: int = 16
    """At most this many nodes in a rack (rack units, top-of-rack switch ports)."""
    feed_racks: int = 2
    """Racks on one power feed (a PDU pair)."""
    zones: int = 3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSpecError(f"--racks: {f.name} must be a whole number >= 1, got {value!r}")

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def parse_domain_spec(text: str) -> DomainSpec:
    """``rack_gpus=32,rack_nodes=16,feed_racks=2,zones=3`` (any subset; ``default`` or '' for all defaults)."""
    if text.strip().lower() in ("", "default"):
        return DomainSpec()
    known = {f.name for f in fields(DomainSpec)}
    values: dict[str, int] = {}
    for item in (i.strip() for i in text.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in known:
            raise InvalidSpecError(f"--racks {text!r}: {item!r} is not KEY=N with KEY one of {sorted(known)}")
        if key in values:
            raise InvalidSpecError(f"--racks {text!r}: {key} is given twice")
        try:
            values[key] = int(value)
        except ValueError:
            raise InvalidSpecError(f"--racks {text!r}: {key}={value!r} is not a whole number") from None
    return DomainSpec(**values)


def assign_domains(nodes: Sequence[Node], spec: DomainSpec, *, seed: int) -> list[Node]:
    """``nodes`` (in their order) with zone, rack and power-feed labels drawn as the module docstring says."""
    rng = random.Random(seed)
    kinds: dict[tuple[str, int, int, int], list[int]] = {}
    for k, n in enumerate(nodes):
        kinds.setdefault((n.gpu_model, n.gpu_count, n.cpu_milli, n.memory_mib), []).append(k)
    racks: list[list[int]] = []
    for members in kinds.values():
        order = list(members)
        rng.shuffle(order)
        per_rack = max(1, min(spec.rack_nodes, spec.rack_gpus // max(1, nodes[order[0]].gpu_count)))
        racks.extend(order[j : j + per_rack] for j in range(0, len(order), per_rack))
    rng.shuffle(racks)
    rack_of: dict[int, tuple[str, str, str]] = {}
    for r, members in enumerate(racks):
        names = (f"z{r % spec.zones}", f"r{r:04d}", f"f{r // spec.feed_racks:04d}")
        for k in members:
            rack_of[k] = names
    out: list[Node] = []
    for k, n in enumerate(nodes):
        zone, rack, feed = rack_of[k]
        labels = {**n.labels, **domain_labels(zone=zone, rack=rack, power_feed=feed)}
        out.append(replace(n, labels=labels))
    return out


def write_domain_nodes(path: Path, nodes: Sequence[Node]) -> None:
    """An openb node file with ``gpu_memory_mib`` and the domain columns."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow((*NODE_HEADER, *DOMAIN_COLUMNS))
        for n in nodes:
            d = domains_of(n)
            card = n.gpus[0].memory_mib if n.gpus else ""
            writer.writerow((n.name, n.cpu_milli, n.memory_mib, n.gpu_count, n.gpu_model, card, d.zone, d.rack,
                             d.power_feed))  # fmt: skip


def describe(nodes: Sequence[Node]) -> dict[str, object]:
    """How many domains of each kind, and the largest rack's share of the fleet's GPUs."""
    total = sum(n.gpu_count for n in nodes) or 1
    racks: dict[str, int] = {}
    for n in nodes:
        rack = domains_of(n).rack
        racks[rack] = racks.get(rack, 0) + n.gpu_count
    return {
        "nodes": len(nodes),
        "racks": len(racks),
        "power_feeds": len({domains_of(n).power_feed for n in nodes}),
        "zones": len({domains_of(n).zone for n in nodes}),
        "largest_rack_gpus": max(racks.values(), default=0),
        "largest_rack_share": round(max(racks.values(), default=0) / total, 4),
    }
