"""What the controller is given: its settings, and the contracts of the seams it reaches the world through (a
readiness prober, the models' footprints, what a fleet watcher saw), with the wake-up its loop sleeps on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from octacloud.control.deployments import Replica
from octacloud.control.sizing import ModelFootprint
from octacloud.core.model import Health, Node

log = logging.getLogger("octacloud.controller")

FootprintSource = Callable[[str], ModelFootprint]
"""Model name → its footprint (from the repository's config parameters and profile)."""


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What a fleet watcher saw: a node joined or came back (HEALTHY), or was lost (FAILED)."""

    node: Node
    health: Health


@dataclass(frozen=True, slots=True)
class Probe:
    """A readiness probe's answer: ready, not (yet) ready, or failed for good (``failed`` says why)."""

    ready: bool
    failed: str = ""


class Prober(Protocol):
    """Readiness of a replica's model. Must return within ``timeout`` seconds and never raise. ``failed`` is set
    only when the replica can never become ready as it is (its model failed to load)."""

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe: ...


@dataclass(slots=True)
class ControllerSettings:
    interval_s: float = 5.0
    health_interval_s: float = 0.5
    startup_timeout_s: float = 120.0
    probe_timeout_s: float = 2.0
    probe_failures_to_fail: int = 3
    ready_probe_interval_s: float = 5.0
    """How often a READY replica's readiness is probed, each at its own phase within the interval (a fleet's probes
    spread over it, not all in every health check); one whose latest probe failed is probed at every check, and a
    starting one too (0: every READY replica at every check). A process that exits is seen at every check."""
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    stop_grace_s: float = 5.0
    """After SIGTERM (a graceful stop), how long a replica has before it is killed."""
    drain_timeout_s: float = 30.0
    """How long a replica taken out of routing may finish the requests it has before it is stopped anyway."""
    stall_after_s: float = 30.0
    """Readiness fails when the controller's loop has not completed an iteration for this long."""


class Wakeup:
    """What the controller's loop sleeps on between ticks: a change that the controller should act on pokes it,
    so that it reconciles at once rather than at the next tick."""

    def __init__(self) -> None:
        self.event: asyncio.Event | None = None
        """Set by :meth:`poke`; made when the loop starts (None before: a poke then does nothing)."""
        self.waiting = 0
        """Replicas the latest pass left pending: while there are any, a released slice wakes the controller, so
        the queue gets it at once (as a scheduler's queue is retried when a pod is deleted), not at the next
        tick."""

    def start(self) -> asyncio.Event:
        self.event = asyncio.Event()
        return self.event

    def poke(self) -> None:
        if self.event is not None:
            self.event.set()

    def slice_freed(self) -> None:
        """A slice was released: reconcile now if something waits for one."""
        if self.waiting:
            self.poke()
