"""Extension points of the scheduling framework: one small contract each (as the Kubernetes scheduler).

A scheduling cycle for one request runs: pre-filter (once) → filter (the candidate nodes) → score (each
scorer rates the feasible nodes) → the runner normalises each scorer's scores to 0..100, weights them and
sums → the best node wins (ties broken by the profile's node order) → the card selector picks the card(s)
on that node → reserve hooks run → the placement is committed to the :class:`ClusterState`.

Plugins are policy; the runner (``runner.py``) is mechanism. Plugins work on *batches* of node indices so that
an implementation can cache per node signature or vectorise: a decision over thousands of nodes must take
milliseconds.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from octacloud.core.model import Request
from octacloud.scheduler.framework.state import ClusterState

MAX_NODE_SCORE = 100.0
MIN_NODE_SCORE = 0.0


class Code(enum.Enum):
    SUCCESS = "success"
    UNSCHEDULABLE = "unschedulable"
    """The request cannot run anywhere in this cycle; the reason says why (e.g. no card of an allowed model)."""
    SKIP = "skip"
    """The plugin does not apply to this request; the runner skips its later extension points."""


@dataclass(frozen=True, slots=True)
class Status:
    code: Code = Code.SUCCESS
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code is not Code.UNSCHEDULABLE


SUCCESS = Status()


@dataclass(slots=True)
class CycleContext:
    """What one scheduling cycle knows: the state, the request, and scratch space shared by plugins."""

    state: ClusterState
    request: Request
    scratch: dict[str, object] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    """Names of plugins whose pre-filter returned SKIP for this request."""


@runtime_checkable
class Plugin(Protocol):
    """Every plugin has a unique ``name`` (used in profiles, diagnostics and metrics)."""

    name: str


@runtime_checkable
class PreFilterPlugin(Plugin, Protocol):
    """Runs once per request before filtering.

    Must not change the state. Returns UNSCHEDULABLE (with a reason) when no node could ever fit the
    request, SKIP when the plugin has nothing to say about it, SUCCESS otherwise.
    """

    def pre_filter(self, ctx: CycleContext) -> Status: ...


@runtime_checkable
class RequestRewriter(Plugin, Protocol):
    """Rewrites a request before its cycle starts (e.g. rounds its GPU share up to the product's unit).

    Must return a valid request with the same name that asks for at least what ``request`` asks for; must not
    change the state. The runner schedules, and the placement takes, what the last rewriter returned.
    """

    def rewrite(self, state: ClusterState, request: Request) -> Request: ...


@runtime_checkable
class FilterPlugin(Plugin, Protocol):
    """Keeps the nodes on which the request can run.

    Must return a subsequence of ``nodes`` (same order, no additions) and must not change the state. A node
    is dropped only for a reason that holds for this request on this node now.
    """

    def filter(self, ctx: CycleContext, nodes: Sequence[int]) -> list[int]: ...


@runtime_checkable
class ScorePlugin(Plugin, Protocol):
    """Rates feasible nodes; higher is better.

    ``score`` returns one finite raw score per node, in order. ``normalize`` maps raw scores onto
    [0, 100]; the runner rejects anything outside that range as a plugin bug. Must not change the state.
    """

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]: ...

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]: ...


@runtime_checkable
class CardSelector(Plugin, Protocol):
    """Chooses the card(s) on the chosen node.

    Must return exactly ``request.num_gpu`` distinct card indices of ``node`` on which the request fits
    (empty for CPU-only requests). The profile's first selector that returns a choice wins; the runner's
    default takes the lowest-index fully free cards for whole-card requests and the fullest card that still
    fits (best fit) for a share.
    """

    def select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None: ...


@runtime_checkable
class ReservePlugin(Plugin, Protocol):
    """Told when a placement is committed and when it is rolled back (bookkeeping only)."""

    def reserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None: ...

    def unreserve(self, ctx: CycleContext, node: int, cards: tuple[int, ...]) -> None: ...


@runtime_checkable
class DemandObserver(Plugin, Protocol):
    """Told the live demand: the requests waiting in the re-evaluation loop's queue, after every pass (a policy
    may weigh what waits, not only the workload it was built with)."""

    def observe_queue(self, pending: Sequence[Request]) -> None: ...


def min_max_normalize(scores: list[float]) -> list[float]:
    """Map scores linearly onto 0..100 (all equal → all 100). The usual normaliser for raw quantities."""
    if not scores:
        return scores
    low, high = min(scores), max(scores)
    if high == low:
        return [MAX_NODE_SCORE] * len(scores)
    span = high - low
    # Clamped: (high - low) * 100 / (high - low) may round to just above 100 (e.g. 100.00000000000001).
    return [min((s - low) * MAX_NODE_SCORE / span, MAX_NODE_SCORE) for s in scores]


def identity_normalize(scores: list[float]) -> list[float]:
    """For plugins whose raw scores are already on 0..100."""
    return scores
