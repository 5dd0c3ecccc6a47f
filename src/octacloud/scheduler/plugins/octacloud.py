"""octacloud's placement: exact fragmentation growth plus CPU stranding and shares' dead space, consolidating.

For every feasible node the plugin computes the exact growth of the node's *unusable idle GPU* under the target
workload, ``Δ = ΔF + ΔS + ΔD`` (milli-GPU):

* ``F`` is FGD's fragmentation (``octacloud.scheduler.fragmentation``): the expected idle milli-GPU that *one*
  task drawn from the workload could not use (for a sharing request, on the card where it grows least);
* ``S`` is CPU and memory stranding, which FGD cannot see because it asks about one task at a time: for each GPU
  shape of the workload, the node's CPU and memory left can host ``min(cpu_left // shape.cpu, memory_left //
  shape.memory)`` more such tasks (memory: the shape's median request, where the workload records it); idle GPU
  beyond what those tasks would take is stranded for that shape. ``S`` is the workload-weighted sum. CPU-only
  shapes, shapes that cannot use the node's GPU model, and multi-card shapes for which the node no longer has
  enough fitting cards add nothing here: ``F`` already counts the node's whole idle GPU for them, and counting it
  again made ``S`` favour breaking the CPU-rich nodes that only the CPU-heavy multi-card tasks can use. A
  CPU-heavy pod on a node with idle cards raises ``S``; the same pod on a CPU-rich node does not.
* ``D`` (shares only) is the *dead space* of the card the share takes: the part of the card's free milli-GPU that
  no combination of the trace's share sizes can fill (:meth:`ConsolidatingFragmentation.dead_space`), before
  and after. ``F`` asks whether one task fits a remainder; ``D`` asks whether the remainder can ever be filled, so
  it tells a 320 next to a 470 (210 left, dead for good) from a 320 next to a 320 (360 left for a third). Share
  sizes too rare for the remainders only they fit are not counted as fillers (:func:`filler_sizes`).

Then, lexicographically: nodes whose ``Δ`` lies within ``tolerance`` milli-GPU of the smallest are near-equal
(an expectation over a workload estimate carries no information far below a card's worth); among them the node
whose share card's dead space grows least wins, then the node left with the least free GPU (explicit
consolidation: keeps other nodes whole for the large requests to come, and puts CPU-only work where the cards are
already spent); then the run's node order (the runner's).

The card for a share follows the same rule: least ``Δ``, near-equal cards broken toward the least dead-space growth,
then the fullest card.

Once capacity has come back (the allocated GPU fell between two decisions: work departed, was undeployed or
moved away), ``S`` and ``D`` stop assuming that what runs on a node stays there (``churn-aware``, on by default):
``D`` is no longer counted (a remainder's neighbour leaves and the card becomes whole again, so pairing for the
leftover's sake no longer pays), near-equal nodes are told apart for a share by what it leaves on its card (the
least first, before the fuller node: the best fit now instead of a bet on the leftover's future), a placement
that removes a copy of a multi-card class gets no credit for the stranded GPU it puts to use (the node's CPU and
memory come back as its work leaves; breaking its whole cards costs the multi-card requests until the node has
drained completely), and ``ΔS`` counts at most ``tolerance`` either way: stranding that lasts only until the
node's work leaves may break a tie of ``F``, never overrule it. A placement that only fills the trace (the
published protocol, the suite) never sees capacity come back and is decided as before.
Results are cached per (request shape, node signature) and per node version, as in ``fgd``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.fragmentation import FragmentationModel, TargetWorkload, compile_workload
from octacloud.scheduler.framework.api import MAX_NODE_SCORE, CycleContext
from octacloud.scheduler.framework.state import ClusterState, NodeSignature
from octacloud.scheduler.plugins.fit import cards_that_fit
from octacloud.scheduler.plugins.octacloud_demand import CACHE_LIMIT, MultiClass, WholeCardDemand, scarcity_costs
from octacloud.scheduler.registry import Args, PluginContext

_Shape = tuple[int, int, int, bool]
_Eval = tuple[float, int, int, tuple[int, ...], tuple[int, ...], float]
"""(Δ unusable idle milli-GPU, growth of the share's card's dead space, free milli-GPU left on the node after the
placement, the card for a share, copies of each multi-card class the placement removes from the node, ``ΔS``: its
part below zero is the stranded idle GPU the placement puts to use)."""
_SCRATCH = "octacloud.evaluations"

DEFAULT_TOLERANCE = 50.0
"""Milli-GPU (5 % of one card): Δs closer than this are near-equal. A unit of the measure, not a fitted value."""


@dataclass(slots=True)
class ConsolidatingFragmentation:
    """Score plugin and card selector: least growth of unusable idle GPU, consolidating among near-equal nodes."""

    node_local: ClassVar[bool] = True
    """Answers from the node's own spec and free capacity only (the runner may decide per node class)."""

    workload: TargetWorkload
    name: str = "octacloud"
    tolerance: float = DEFAULT_TOLERANCE
    stranding: bool = True
    """Count CPU and memory stranding (``S``); off leaves exact FGD fragmentation with consolidation."""
    pairing: bool = True
    """Count the dead space a share leaves on its card (``D``); off leaves ``F + S`` and the fullest card."""
    scarcity: bool = True
    """Count the restricted demand a placement displaces from a GPU model (``R``); off: no such term."""
    whole_cards: bool = True
    """Count the multi-card demand a placement leaves without whole cards (``M``); off (profile argument
    ``multi-card-scarcity: false``) leaves ``F + S + D + R``."""
    churn_aware: bool = True
    """Once capacity has come back, no ``D``, no stranding credit for breaking multi-card capacity and ``ΔS`` held
    within the tolerance (module docstring); off (profile argument ``churn-aware: false``): decide as if nothing
    ever left."""
    model: FragmentationModel = field(init=False)
    _gpu_shapes: list[tuple[float, int, int, int, frozenset[str], int]] = field(default_factory=list, init=False)
    _strand_cache: dict[tuple[str, int, int, tuple[int, ...]], float] = field(default_factory=dict, init=False)
    _share_sizes: tuple[int, ...] = field(default=(), init=False)
    _restricted: tuple[tuple[frozenset[str], float, float], ...] = field(default=(), init=False)
    _multi: tuple[MultiClass, ...] = field(default=(), init=False)
    _demand: WholeCardDemand = field(init=False)
    _dead: dict[int, int] = field(default_factory=dict, init=False)
    _cache: dict[_Shape, dict[NodeSignature, _Eval]] = field(default_factory=dict, init=False)
    _by_node: dict[_Shape, tuple[list[int], list[_Eval | None]]] = field(default_factory=dict, init=False)
    _state: ClusterState | None = field(default=None, init=False)
    _size: int = field(default=0, init=False)
    _returns_state: ClusterState | None = field(default=None, init=False)
    _last_allocated: int = field(default=0, init=False)
    _returned: bool = field(default=False, init=False)
    """Capacity has come back on the state decided on (:meth:`capacity_returned`)."""

    def __post_init__(self) -> None:
        if not self.tolerance >= 0:
            raise InvalidSpecError(f"plugin {self.name!r}: tolerance must be >= 0 milli-GPU, got {self.tolerance}")
        self.model = compile_workload(self.workload)
        memories = self.workload.memory_mib or (0,) * len(self.workload.shapes)
        self._gpu_shapes = [
            (p, s.cpu_milli, s.gpu_milli, s.num_gpu, s.gpu_models, m)
            for s, p, m in zip(self.workload.shapes, self.workload.probabilities, memories, strict=True)
            if s.num_gpu and s.cpu_milli > 0
        ]
        self._share_sizes = filler_sizes(self.workload)
        self._restricted = self.workload.restricted_demand if self.scarcity else ()
        self._multi = self.workload.multi_demand if self.whole_cards else ()
        self._demand = WholeCardDemand(self._multi)

    # ---- score -----------------------------------------------------------------------------------------

    def score(self, ctx: CycleContext, nodes: Sequence[int]) -> list[float]:
        """Raw score: −Δ (the evaluations stay in the cycle's scratch for :meth:`normalize`)."""
        returned = self.capacity_returned(ctx.state)
        evaluations = self._evaluations(ctx, nodes)
        if returned and self._multi and ctx.request.total_gpu_milli:
            # no credit for stranded GPU put to use where the placement breaks multi-card capacity
            evaluations = [
                (e[0] - min(e[5], 0.0), *e[1:5], max(e[5], 0.0)) if any(e[4]) else e  # type: ignore[misc]
                for e in evaluations
            ]
        if self._restricted and ctx.request.total_gpu_milli:
            costs = self.scarcity_costs(ctx.state)
            if costs:
                milli, sigs = ctx.request.total_gpu_milli, ctx.state.signature
                evaluations = [
                    (e[0] + milli * costs.get(sigs[i].gpu_model, 0.0), *e[1:])  # type: ignore[misc]
                    for e, i in zip(evaluations, nodes, strict=True)
                ]
        if self._multi and ctx.request.total_gpu_milli:
            weights = self.whole_card_costs(ctx.state)
            if weights:
                evaluations = [
                    (e[0] + sum(n * w for n, w in zip(e[4], weights, strict=True)), *e[1:])  # type: ignore[misc]
                    for e in evaluations
                ]
        if returned:
            # S speaks only within the tolerance: the CPU and memory it counts come back as work leaves
            t = self.tolerance
            evaluations = [
                (e[0] - e[5] + min(max(e[5], -t), t), *e[1:]) if e[5] else e  # type: ignore[misc]
                for e in evaluations
            ]
        ctx.scratch[_SCRATCH] = evaluations
        return [-e[0] for e in evaluations]

    def normalize(self, ctx: CycleContext, scores: list[float]) -> list[float]:
        """The lexicographic order (near-equal Δ, then the fuller node) mapped onto 0..100, best = 100."""
        evaluations = ctx.scratch.pop(_SCRATCH, None)
        if not isinstance(evaluations, list) or len(evaluations) != len(scores):
            raise InvalidSpecError(f"plugin {self.name!r}: normalize called without its score call")
        limit = min(e[0] for e in evaluations) + self.tolerance
        keys = [(False, 0.0, e[1], e[2]) if e[0] <= limit else (True, e[0], e[1], e[2]) for e in evaluations]
        order = sorted(set(keys))
        if len(order) == 1:
            return [MAX_NODE_SCORE] * len(scores)
        rank = {k: r for r, k in enumerate(order)}
        last = len(order) - 1
        return [MAX_NODE_SCORE * (last - rank[k]) / last for k in keys]

    def capacity_returned(self, state: ClusterState) -> bool:
        """Whether capacity has come back on ``state``: its allocated GPU was lower at some decision than at the one
        before (work departed, was undeployed or moved away). Always ``False`` with ``churn_aware`` off, and for a
        placement that only fills the cluster (the trace protocol)."""
        if not self.churn_aware:
            return False
        allocated = state.allocated_gpu_milli
        if state is not self._returns_state:
            self._returns_state, self._returned = state, False
        elif allocated < self._last_allocated:
            self._returned = True
        self._last_allocated = allocated
        return self._returned

    # ---- cards -----------------------------------------------------------------------------------------

    def select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None:
        if not ctx.request.is_sharing:
            return None  # whole cards: the lowest-index fully free ones (the runner's default)
        return self._evaluate(ctx, node)[3] or None

    # ---- evaluation ------------------------------------------------------------------------------------

    def _evaluations(self, ctx: CycleContext, nodes: Sequence[int]) -> list[_Eval]:
        r, state = ctx.request, ctx.state
        if r.gpu_memory_mib or r.gpu_models:  # card choice depends on more than the signature
            return [self._evaluate(ctx, i) for i in nodes]
        if state is not self._state or self._size > CACHE_LIMIT:
            self._state = state
            self._cache.clear()
            self._by_node.clear()
            self._size = 0
        shape = (r.cpu_milli, r.gpu_milli, r.num_gpu, self._returned)
        cache = self._cache.get(shape)
        if cache is None:
            cache = self._cache[shape] = {}
            self._by_node[shape] = ([-1] * len(state), [None] * len(state))
        seen_version, seen = self._by_node[shape]
        versions, sigs = state.version, state.signature
        out: list[_Eval] = []
        for i in nodes:
            hit = seen[i]
            if hit is None or seen_version[i] != versions[i]:
                hit = cache.get(sigs[i])
                if hit is None:
                    hit = cache[sigs[i]] = self._evaluate(ctx, i)
                    self._size += 1
                seen_version[i], seen[i] = versions[i], hit
            out.append(hit)
        return out

    def _evaluate(self, ctx: CycleContext, node: int) -> _Eval:
        state, r = ctx.state, ctx.request
        gpu_model, cpu_left, memory, free = state.signature[node]
        frag = self.model.fragmentation
        cpu_after = cpu_left - r.cpu_milli
        memory_after = memory - r.memory_mib
        left = sum(free) - r.total_gpu_milli
        strand = self.stranded
        frag_before = frag(gpu_model, cpu_left, free)
        strand_before = strand(gpu_model, cpu_left, free, memory)
        pairing = not self._returned  # D assumes a share's neighbour stays
        if r.is_sharing:
            best: tuple[float, int, int, int] | None = None
            strand_delta = 0.0
            for g in cards_that_fit(state, r, node):
                after = list(free)
                after[g] -= r.gpu_milli
                stranding = strand(gpu_model, cpu_after, after, memory_after) - strand_before
                growth = frag(gpu_model, cpu_after, after) - frag_before + stranding
                dead = self.dead_space(after[g]) - self.dead_space(free[g]) if pairing else 0
                candidate = (growth + dead, dead, after[g], g)
                if best is None or _better(candidate, best, self.tolerance):
                    best, strand_delta = candidate, stranding
            if best is None:
                return (float("inf"), 0, left, (), (), 0.0)
            after = list(free)
            after[best[3]] -= r.gpu_milli
            lost = self._demand.lost(
                state.signature[node], NodeSignature(gpu_model, cpu_after, memory_after, tuple(after))
            )
            # once capacity has come back D is off: near-equal nodes are told apart by the card's remainder instead
            tie = best[1] if pairing else best[2]
            return (best[0], tie, left, (best[3],), lost, strand_delta)
        after = list(free)
        if r.num_gpu:
            whole = [g for g in cards_that_fit(state, r, node) if free[g] == MILLI_PER_GPU][: r.num_gpu]
            for g in whole:
                after[g] = 0
        stranding = strand(gpu_model, cpu_after, after, memory_after) - strand_before
        growth = frag(gpu_model, cpu_after, after) - frag_before + stranding
        lost = self._demand.lost(state.signature[node], NodeSignature(gpu_model, cpu_after, memory_after, tuple(after)))
        return (growth, 0, left, (), lost, stranding)

    # ---- R and M: the demand to come (octacloud_demand) ------------------------------------------------

    def copies(self, sig: NodeSignature) -> tuple[int, ...]:
        """How many requests of each multi-card class a node in state ``sig`` can still host
        (:meth:`WholeCardDemand.copies`)."""
        return self._demand.copies(sig)

    def observe_queue(self, pending: Sequence[Request]) -> None:
        """Record the multi-card demand that waits in the loop's queue (:meth:`WholeCardDemand.observe_queue`)."""
        self._demand.observe_queue(pending)

    def whole_card_costs(self, state: ClusterState) -> tuple[float, ...]:
        """``M`` per copy of each multi-card class a placement removes, or ``()`` while every chance is negligible
        (:meth:`WholeCardDemand.costs`)."""
        return self._demand.costs(state)

    def scarcity_costs(self, state: ClusterState) -> dict[str, float]:
        """``R`` per milli-GPU on each GPU model
        (:func:`~octacloud.scheduler.plugins.octacloud_demand.scarcity_costs`)."""
        return scarcity_costs(self._restricted, state)

    def dead_space(self, free: int) -> int:
        """``D``: the milli-GPU of a shared card's ``free`` that no combination of the workload's share sizes fills
        (``free`` minus the largest sum of share sizes, repeats allowed, that fits in it); 0 for a whole free card.
        """
        if not self.pairing or free <= 0 or free >= MILLI_PER_GPU:
            return 0
        value = self._dead.get(free)
        if value is None:
            value = free
            for size in self._share_sizes:
                if size > free:
                    break
                value = min(value, self.dead_space(free - size) if free - size > 0 else 0)
            self._dead[free] = value
        return value

    def stranded(
        self, gpu_model: str, cpu_left: int, free: tuple[int, ...] | list[int], memory_left: int | None = None
    ) -> float:
        """``S``: expected idle milli-GPU on the node that the workload's GPU tasks could not use for lack of CPU or
        memory (``memory_left=None``: CPU only).

        For each GPU shape that may use the node's model and still finds enough cards for one task, the CPU and
        memory left host ``min(cpu_left // shape.cpu, memory_left // shape.memory)`` copies; idle GPU beyond what
        those copies would take is stranded for that shape.
        """
        free_gpu = sum(free)
        if not self.stranding or free_gpu <= 0:
            return 0.0
        cards = tuple(sorted(free))
        key = (gpu_model, cpu_left, -1 if memory_left is None else memory_left, cards)
        value = self._strand_cache.get(key)
        if value is None:
            value = 0.0
            cpu = max(cpu_left, 0)
            for p, cpu_milli, milli, num, models, memory_mib in self._gpu_shapes:
                if models and gpu_model not in models:
                    continue  # F counts the node's whole idle GPU for this shape already
                if num > 1 and len(cards) - bisect_left(cards, milli) < num:
                    continue  # not enough cards for one task: F counts the whole idle GPU for it already
                copies = cpu // cpu_milli
                if memory_left is not None and memory_mib > 0:
                    copies = min(copies, max(memory_left, 0) // memory_mib)
                usable = copies * milli * num
                if usable < free_gpu:
                    value += p * (free_gpu - usable)
            if len(self._strand_cache) >= CACHE_LIMIT:
                self._strand_cache.clear()
            self._strand_cache[key] = value
        return value


def filler_sizes(workload: TargetWorkload) -> tuple[int, ...]:
    """The share sizes (milli-GPU, one card) of ``workload`` that can be counted on to fill a card's leftover.

    The sizes are the workload's ``share_sizes`` (every share size of the trace, also those of shapes below the
    coverage: a 330 or 440 split over many CPU requests still arrives).

    A size is *saturated* when the remainders that only it or smaller sizes can fill (a card's remainder after one
    share, ``1000 − t``, at least the size but below the next larger share size) come more often than shares of it
    or smaller sizes do: most such remainders then stay idle, and a leftover "filled" by such a size is not filled.
    That size and every smaller one are left out. (openb: the 810 share leaves 190, which only 160 fits; 810 shapes
    weigh about twenty times the 160 shapes.)
    """
    weights = dict(workload.share_sizes)
    sizes = sorted(weights)
    smallest = 0
    for k, size in enumerate(sizes):
        upper = sizes[k + 1] if k + 1 < len(sizes) else MILLI_PER_GPU
        demand = sum(p for t, p in weights.items() if size <= MILLI_PER_GPU - t < upper)
        supply = sum(p for t, p in weights.items() if t <= size)
        if demand > supply:
            smallest = k + 1
    return tuple(sizes[smallest:])


def _better(candidate: tuple[float, int, int, int], best: tuple[float, int, int, int], tolerance: float) -> bool:
    """Card order: clearly less Δ wins; within the tolerance, less dead-space growth, then the fuller card (less
    left), then the lower index."""
    if candidate[0] < best[0] - tolerance:
        return True
    if candidate[0] > best[0] + tolerance:
        return False
    return candidate[1:] < best[1:]


def build(name: str, args: Args, ctx: PluginContext) -> ConsolidatingFragmentation:
    if ctx.workload is None:
        raise InvalidSpecError(
            f"{args.where}: plugin 'octacloud' needs a target workload (build the profile with workload=...)"
        )
    tolerance = args.number("tolerance", DEFAULT_TOLERANCE, low=0.0)
    stranding = args.flag("cpu-stranding", True)
    pairing = args.flag("share-pairing", True)
    scarcity = args.flag("gpu-scarcity", True)
    whole_cards = args.flag("multi-card-scarcity", True)
    churn_aware = args.flag("churn-aware", True)
    args.finish()
    return ConsolidatingFragmentation(
        ctx.workload, name, tolerance, stranding, pairing, scarcity, whole_cards, churn_aware
    )
