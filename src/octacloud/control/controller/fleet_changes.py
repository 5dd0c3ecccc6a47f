"""The fleet changing under the controller: a node or card that fails (its replicas fail over to other cards,
using the failover headroom) or recovers, a node that joins (the scheduler may use it at once), and a node whose
MPS server died (its GPU replicas lost their CUDA contexts and restart on their slices)."""

from __future__ import annotations

from collections.abc import Sequence

from octacloud.control.controller.contracts import NodeChange, Wakeup
from octacloud.control.controller.events import EventLog
from octacloud.control.controller.health import HealthChecker
from octacloud.control.controller.lifecycle import Lifecycle
from octacloud.control.controller.reservations import Reservations
from octacloud.control.controller.state import ControllerStore, copied
from octacloud.control.deployments import Replica
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core.model import Health, Node
from octacloud.scheduler.loop import ReevaluationLoop


class FleetChanges:
    def __init__(
        self,
        *,
        store: ControllerStore,
        reservations: Reservations,
        lifecycle: Lifecycle,
        health: HealthChecker,
        loop: ReevaluationLoop,
        events: EventLog,
        wakeup: Wakeup,
    ) -> None:
        self.store, self.reservations, self.lifecycle, self.health = store, reservations, lifecycle, health
        self.loop, self.events, self.wakeup = loop, events, wakeup

    def mark_node(self, name: str, health: Health) -> None:
        """A node failed (or recovered): its replicas are re-placed elsewhere on the next pass."""
        self.reservations.scheduler.state.set_node_health(name, health)
        self.events.fleet(name, health.value)
        if health is Health.FAILED:
            self._fail_over([copied(r) for r in self._on(name)], f"node {name} failed")
        self.wakeup.poke()

    def mark_card(self, node: str, gpu: int, health: Health, reason: str) -> None:
        """A card's health changed (NVML: an XID, ECC errors, a lost GPU): a DEGRADED card takes no new
        replicas; a FAILED one also fails its replicas over to other cards (using the failover headroom)."""
        self.reservations.scheduler.state.set_card_health(node, gpu, health)
        self.events.fleet(node, f"card {gpu} {health.value}: {reason}")
        if health is Health.FAILED:
            on_card = [copied(r) for r in self._on(node) if gpu in r.gpus]
            self._fail_over(on_card, f"card {gpu} of {node} failed ({reason})")
        self.wakeup.poke()

    def restart_gpu_replicas(self, node: str, why: str) -> None:
        """The GPU replicas of ``node`` lost their CUDA contexts (its MPS server died): each restarts on its
        slice, with the usual back-off."""
        nodes = self.reservations.nodes
        gpu_cards = {g.index for n in nodes if n.name == node for g in n.gpus if g.model != CPU_CARD_MODEL}
        for r in self._on(node):
            if r.handle and gpu_cards.intersection(r.gpus):
                self.health.failed(copied(r), why, kill=True)
        self.wakeup.poke()

    def _on(self, node: str) -> list[Replica]:
        """The replicas placed on ``node``, as stored, in id order (look; change a copy)."""
        return sorted((r for r in self.store.peek_replicas() if r.node == node), key=lambda r: r.id)

    def _fail_over(self, replicas: list[Replica], why: str) -> None:
        for r in replicas:
            if r.replaces:  # a replacement that was starting there: undone
                self.health.failed(r, why, kill=True)
                continue
            self.lifecycle.unroute(r.id, gone=True)  # first: the gateway stops routing there, ends what is in flight
            if r.handle:
                self.lifecycle.kill(r.handle)
            self.reservations.release(r.id)
            r.unplace(why, failover=True)
            self.store.put_replica(r)
            self.events.replica("failover", r, f"{why}: re-placed elsewhere")

    def node_changed(self, change: NodeChange) -> None:
        """Apply what a fleet watcher saw: a new node joins the fleet, a known node that was lost comes back, or
        a node is lost (its replicas are re-placed on the others)."""
        name = change.node.name
        state = self.reservations.scheduler.state
        if change.health is Health.FAILED:
            if name in state.index and state.nodes[state.index[name]].health is not Health.FAILED:
                self.mark_node(name, Health.FAILED)
            return
        if name not in state.index:
            self._join([change.node])
        elif state.nodes[state.index[name]].health is not Health.HEALTHY:
            self.mark_node(name, Health.HEALTHY)

    def nodes_changed(self, changes: Sequence[NodeChange]) -> None:
        """:meth:`node_changed` for each of ``changes``, in order, but the nodes that join join together: one rebuild
        of the scheduler's state for all of them (one each costs the allocations times the nodes that join)."""
        state = self.reservations.scheduler.state
        joining: dict[str, Node] = {}
        for c in changes:
            if c.health is not Health.FAILED and c.node.name not in state.index:
                joining.setdefault(c.node.name, c.node)
        if joining:
            self._join(list(joining.values()))
        for c in changes:
            if joining.get(c.node.name) is not c.node:
                self.node_changed(c)

    def _join(self, nodes: list[Node]) -> None:
        self.loop.scheduler = self.reservations.grow(*nodes)
        for node in nodes:
            self.events.fleet(node.name, f"joined: {node.gpu_count} × {node.gpu_model or 'no card'}")
        self.wakeup.poke()
