"""Transactions: allocate, evict and move with checkpoints, rollback and commit (as KAI-Scheduler's Statement).

Every disruptive change (preemption, defragmentation) goes through a transaction so that a plan which turns
out not to work leaves the cluster exactly as it was. The transaction keeps an undo log of the operations it
applied to the :class:`ClusterState`; rollback replays it backwards. As KAI's statement fires its plugins'
allocate and deallocate handlers, every allocate (and every undone evict) tells the reserve plugins
``reserve``, and every evict (and every undone allocate) tells them ``unreserve``, so that their bookkeeping
never drifts from the state, trial plans included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from octacloud.core.model import Placement, Request
from octacloud.scheduler.framework.api import CycleContext, ReservePlugin
from octacloud.scheduler.framework.state import Allocation, ClusterState


@dataclass(frozen=True, slots=True)
class Operation:
    kind: Literal["allocate", "evict"]
    request: Request
    placement: Placement


@dataclass(slots=True)
class Transaction:
    """A reversible sequence of changes to a :class:`ClusterState`.

    Use as a context manager: leaving the block with an exception rolls back; otherwise call
    :meth:`commit` (leaving the block without committing also rolls back, so a forgotten commit never
    leaks a half-done plan).
    """

    state: ClusterState
    reservers: Sequence[ReservePlugin] = ()
    """Told of every allocation made and given back (usually the scheduler profile's reserve plugins)."""
    log: list[Operation] = field(default_factory=list)
    closed: bool = False

    def allocate(self, request: Request, placement: Placement) -> Allocation:
        self._check_open()
        allocation = self._allocate(request, placement)
        self.log.append(Operation("allocate", request, placement))
        return allocation

    def evict(self, name: str) -> Allocation:
        self._check_open()
        allocation = self._release(name)
        self.log.append(Operation("evict", allocation.request, allocation.placement))
        return allocation

    def move(self, name: str, placement: Placement) -> Allocation:
        """Move request ``name`` to ``placement`` (make-before-break is the caller's plan; here it is atomic)."""
        allocation = self.evict(name)
        moved = Placement(name, placement.node, placement.gpus, placement.milli_per_gpu)
        return self.allocate(allocation.request, moved)

    def checkpoint(self) -> int:
        """A mark to roll back to later (the number of operations applied so far)."""
        self._check_open()
        return len(self.log)

    def rollback(self, to: int = 0) -> None:
        """Undo every operation after checkpoint ``to`` (all of them by default)."""
        self._check_open()
        while len(self.log) > to:
            op = self.log.pop()
            if op.kind == "allocate":
                self._release(op.request.name)
            else:
                self._allocate(op.request, op.placement)
        if to == 0:
            self.closed = True

    def commit(self) -> list[Operation]:
        """Make the changes final and return them (for the caller to act on: stop, start, move replicas)."""
        self._check_open()
        self.closed = True
        return list(self.log)

    def evicted(self) -> list[Allocation]:
        """What was evicted and not re-allocated in this transaction, in order."""
        live = {op.request.name for op in self.log if op.kind == "allocate"}
        out: list[Allocation] = []
        for op in self.log:
            if op.kind == "evict" and op.request.name not in live:
                out.append(Allocation(op.request, op.placement, self.state.node_index(op.placement.node)))
        return out

    def _allocate(self, request: Request, placement: Placement) -> Allocation:
        allocation = self.state.allocate(request, placement)
        ctx = CycleContext(self.state, request)
        for r in self.reservers:
            r.reserve(ctx, allocation.node_index, placement.gpus)
        return allocation

    def _release(self, name: str) -> Allocation:
        allocation = self.state.release(name)
        ctx = CycleContext(self.state, allocation.request)
        for r in self.reservers:
            r.unreserve(ctx, allocation.node_index, allocation.placement.gpus)
        return allocation

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("transaction is already committed or rolled back")

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.closed:
            self.rollback()
