"""Generated fleets: a fleet file for a fleet of any size (``octacloud fleet generate``), for an emulated cloud
(``octacloud up --fleet FILE --emulate``) and the fleet-scale benchmark.

Nodes are named ``<rack>-n<k>`` and declare their ``rack`` and ``zone`` as failure domains (the fleet file's
``rack:`` and ``zone:`` keys, so that status, top, the dashboard and the scheduler's rack spread see the racks),
racks filling zones in order; the card models cycle node by node over ``models`` (``NAME:MiB``), so a fleet mixes
them evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node

DEFAULT_MODELS = ("H100:81920", "A100:81920", "L40S:46068", "T4:16384")


@dataclass(frozen=True, slots=True)
class FleetShape:
    """What to generate: ``nodes`` nodes of ``cards`` cards each, in ``racks`` racks over ``zones`` zones."""

    nodes: int = 125
    cards: int = 8
    racks: int = 5
    zones: int = 1
    models: Sequence[str] = DEFAULT_MODELS
    cpu_milli_per_card: int = 16_000
    memory_mib_per_card: int = 131_072

    def __post_init__(self) -> None:
        for name in ("nodes", "cards", "racks", "zones", "cpu_milli_per_card", "memory_mib_per_card"):
            if getattr(self, name) < 1:
                raise InvalidSpecError(f"a generated fleet needs {name} ≥ 1, got {getattr(self, name)}")
        if self.racks > self.nodes:
            raise InvalidSpecError(f"{self.racks} racks for {self.nodes} node(s): give at most one rack per node")
        if self.zones > self.racks:
            raise InvalidSpecError(f"{self.zones} zones for {self.racks} rack(s): give at most one zone per rack")
        if not self.models:
            raise InvalidSpecError("a generated fleet needs at least one card model (NAME:MiB)")
        for m in self.models:
            card_models((m,))


def card_models(models: Sequence[str]) -> list[tuple[str, int]]:
    """``NAME:MiB`` → (name, MiB); refuses anything else, naming it."""
    out = []
    for m in models:
        name, _, memory = m.partition(":")
        if not name or not memory.isdigit() or int(memory) < 1:
            raise InvalidSpecError(f"card model {m!r}: write NAME:MiB, e.g. A100:81920")
        out.append((name, int(memory)))
    return out


def fleet_document(shape: FleetShape) -> dict[str, Any]:
    """The fleet file (as parsed YAML) of ``shape``."""
    models = card_models(shape.models)
    per_rack = -(-shape.nodes // shape.racks)
    racks_per_zone = -(-shape.racks // shape.zones)
    nodes = []
    for k in range(shape.nodes):
        rack = k // per_rack
        model, memory = models[k % len(models)]
        nodes.append(
            {
                "name": f"r{rack:02d}-n{k % per_rack:02d}",
                "cpu_milli": shape.cpu_milli_per_card * shape.cards,
                "memory_mib": shape.memory_mib_per_card * shape.cards,
                "zone": f"z{rack // racks_per_zone}",
                "rack": f"r{rack:02d}",
                "gpu_count": shape.cards,
                "gpu_model": model,
                "gpu_memory_mib": memory,
            }
        )
    return {"nodes": nodes}


def generated_fleet(shape: FleetShape) -> list[Node]:
    """The nodes of ``shape``, read back as a fleet file is."""
    from octacloud.control.fleet import parse_fleet

    return parse_fleet(fleet_document(shape), f"generated fleet {shape.nodes}×{shape.cards}")


def fleet_yaml(shape: FleetShape) -> str:
    header = (
        f"# octacloud fleet generate: {shape.nodes} node(s) × {shape.cards} card(s) in {shape.racks} rack(s), "
        f"{shape.zones} zone(s); card models {', '.join(shape.models)}\n"
    )
    return header + yaml.safe_dump(fleet_document(shape), sort_keys=False, width=120)
