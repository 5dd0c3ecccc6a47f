"""Make-before-break replacements in flight: where each stands (:class:`Phase`) and what is stored of it
(:class:`Transition`). The machine that moves them is :mod:`octacloud.control.controller.replacement`; the
stores keep them (:mod:`octacloud.control.store`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.StrEnum):
    """Where a make-before-break replacement stands (the machine that moves it is
    :mod:`octacloud.control.controller.replacement`). The first four are stored, each before it begins; the last
    two end it, and its record is deleted."""

    STARTING = "starting"
    """Its replacement replica is placed and starts; the source serves."""
    ROUTING = "routing"
    """The replacement is READY and is being routed to."""
    DRAINING = "draining"
    """The source is out of routing, finishes what it has in flight, and is stopped."""
    RELEASING = "releasing"
    """The source has stopped: its record and slice are released."""
    DONE = "done"
    """The replacement took over."""
    UNDONE = "undone"
    """Rolled back: the source serves on (or nothing was left to take over)."""


PHASES = (Phase.STARTING, Phase.ROUTING, Phase.DRAINING, Phase.RELEASING)
"""The phases a replacement in flight is stored in, in order."""


@dataclass(slots=True)
class Transition:
    """A make-before-break replacement in flight: ``replacement`` takes over from ``source``.

    ``kind`` is "move" (defragmentation: the source's slice was already given to what the pass placed there,
    and ``node``/``gpus``/``milli_per_gpu`` is the target slice reserved for the replacement) or "update" (a
    rolling-update step: the source keeps its own slice until it stops)."""

    replacement: str
    source: str
    kind: str
    deployment: str
    phase: str = "starting"
    node: str = ""
    gpus: tuple[int, ...] = ()
    milli_per_gpu: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("move", "update"):
            raise ValueError(f"transition kind must be 'move' or 'update', got {self.kind!r}")
        if self.phase not in PHASES:
            raise ValueError(f"transition phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
