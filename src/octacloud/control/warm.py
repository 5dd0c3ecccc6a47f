"""Warm copies for the failover reserve: each deployment's model kept in the caches of the nodes a failover
would most likely land on, so that a failover does not wait for a download (``--warm-copies N``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from octacloud.control.controller import Controller
from octacloud.core.model import Health

log = logging.getLogger("octacloud.storage")


def warm_copy_nodes(free_milli: dict[str, int], running: set[str], copies: int) -> list[str]:
    """The nodes that get a warm copy of a deployment's model: the ``copies`` nodes without one of its replicas
    that have the most free GPU (where the failover reserve is), by name on ties."""
    spare = sorted((n for n in free_milli if n not in running), key=lambda n: (-free_milli[n], n))
    return spare[: max(0, copies)]


def warm_once(controller: Controller, copies: int) -> None:
    """Ask for each deployment's warm copies (a prefetch of a model already cached is a cache check)."""
    state = controller.scheduler.state
    free = {n.name: state.free_gpu_milli(i) for i, n in enumerate(state.nodes) if n.health is Health.HEALTHY}
    for d, replicas in controller.status():
        running = {r.node for r in replicas if r.node}
        for node in warm_copy_nodes(free, running, copies):
            controller.prefetch(node, d.spec.model, d.spec.version)


async def keep_warm_copies(controller: Controller, copies: int, stop: asyncio.Event) -> None:
    """Every reconcile interval until ``stop``: :func:`warm_once`."""
    while not stop.is_set():
        try:
            warm_once(controller, copies)
        except Exception:
            log.exception("warm copies for the failover reserve failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), controller.settings.interval_s)
