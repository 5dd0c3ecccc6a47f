"""The runner: mechanism that drives a profile's plugins through one scheduling cycle.

The runner, not the plugins, normalises each scorer's scores to 0..100, range-checks them, applies the
profile's weights and breaks ties. Ties go to the node that comes first in the profile's node order: the
authors of FGD broke ties by node name with a random per-run prefix, i.e. one random node priority order per
run, and a seeded permutation reproduces that.

When every filter and scorer of a cycle declares ``node_local`` (see ``index.py`` and docs/scheduler.md), the
runner filters and scores one node per class of equal nodes — the member first in the node order — instead of
every node: the scorers see the same set of values, so the same node wins with the same score, and the reasons
count the same nodes. Otherwise (or with ``Scheduler(indexed=False)``) it visits every node.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence, Set
from dataclasses import dataclass, field, fields

from octacloud.core.model import Placement, Request
from octacloud.core.units import MILLI_PER_GPU
from octacloud.scheduler.framework.api import (
    MAX_NODE_SCORE,
    MIN_NODE_SCORE,
    CardSelector,
    Code,
    CycleContext,
    FilterPlugin,
    PreFilterPlugin,
    RequestRewriter,
    ReservePlugin,
    ScorePlugin,
)
from octacloud.scheduler.framework.index import NodeClasses
from octacloud.scheduler.framework.state import Allocation, ClusterState
from octacloud.scheduler.framework.transaction import Transaction

_REQUEST_FIELDS = tuple(f.name for f in fields(Request) if f.name != "name")
"""What a filter may read of a request: every field but the name (the shape the index caches verdicts for)."""
MAX_EXCLUDED = 64
"""``decide(nodes=...)`` uses the index when ``nodes`` leaves out at most this many nodes."""
_NONE_EXCLUDED: Set[int] = frozenset()


class PluginError(RuntimeError):
    """A plugin broke its contract (e.g. a score outside 0..100 after normalisation)."""


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    plugin: ScorePlugin
    weight: float


@dataclass(slots=True)
class Decision:
    """The outcome of one cycle: a placement, or the reasons no node qualified."""

    request: Request
    placement: Placement | None
    reasons: dict[str, int] = field(default_factory=dict)
    """Plugin name → nodes it filtered out (or a pre-filter's reason → 1)."""
    score: float = 0.0

    @property
    def placed(self) -> bool:
        return self.placement is not None

    def explain(self) -> str:
        if self.placement is not None:
            return f"{self.request.name} → {self.placement.node} cards {list(self.placement.gpus)}"
        parts = ", ".join(f"{why}: {n}" for why, n in sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        return f"{self.request.name} fits nowhere ({parts or 'no nodes'})"


@dataclass(slots=True)
class Profile:
    """A named set of plugins with weights: the policy the runner executes."""

    name: str
    rewriters: list[RequestRewriter] = field(default_factory=list)
    pre_filters: list[PreFilterPlugin] = field(default_factory=list)
    filters: list[FilterPlugin] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    card_selectors: list[CardSelector] = field(default_factory=list)
    reservers: list[ReservePlugin] = field(default_factory=list)
    random_choice: bool = False
    """Pick uniformly among feasible nodes at every decision (the published Random baseline)."""
    seed: int = 0
    """Seeds the node tie-break order and any random choice."""
    description: str = ""

    def plugins(self) -> list[object]:
        """Every plugin instance of the profile, once each, in extension-point order."""
        seen: dict[int, object] = {}
        groups: list[list[object]] = [
            list(self.rewriters),
            list(self.pre_filters),
            list(self.filters),
            [ws.plugin for ws in self.scorers],
            list(self.card_selectors),
            list(self.reservers),
        ]
        for group in groups:
            for plugin in group:
                seen.setdefault(id(plugin), plugin)
        return list(seen.values())


class Scheduler:
    """Places requests on a :class:`ClusterState` according to a :class:`Profile`."""

    def __init__(self, state: ClusterState, profile: Profile, *, indexed: bool = True) -> None:
        self.state = state
        self.profile = profile
        self._rng = random.Random(profile.seed)
        order = list(range(len(state)))
        random.Random(profile.seed).shuffle(order)
        self.tie_rank: list[int] = [0] * len(order)
        for rank, i in enumerate(order):
            self.tie_rank[i] = rank
        self._all_nodes = list(range(len(state)))
        self.indexed = indexed
        """Decide over node classes where the profile allows it (``False``: always visit every node)."""
        self._classes: NodeClasses | None = None

    def decide(
        self, request: Request, nodes: Sequence[int] | None = None, *, exclude: Collection[int] = ()
    ) -> Decision:
        """Choose a placement for ``request`` without committing it (``decision.request`` is what was scheduled,
        after the profile's rewriters), among ``nodes`` (default: all) except those in ``exclude``."""
        for rw in self.profile.rewriters:
            request = rw.rewrite(self.state, request)
        ctx = CycleContext(self.state, request)
        decision = Decision(request, None)
        for pf in self.profile.pre_filters:
            status = pf.pre_filter(ctx)
            if status.code is Code.UNSCHEDULABLE:
                decision.reasons[f"{pf.name}: {status.reason}"] = 1
                return decision
            if status.code is Code.SKIP:
                ctx.skipped.add(pf.name)
        excluded = self._excluded(ctx, nodes, exclude) if self.indexed else None
        if excluded is not None:
            candidates = self._feasible_representatives(ctx, decision, excluded)
        else:
            candidates = self._all_nodes if nodes is None else list(nodes)
            if exclude:
                left_out = set(exclude)
                candidates = [i for i in candidates if i not in left_out]
            candidates = self._feasible(ctx, decision, candidates)
        if not candidates:
            return decision
        best, score = self._pick(ctx, candidates)
        cards = self._select_cards(ctx, best)
        if cards is None:
            decision.reasons["card selection"] = 1
            return decision
        milli = request.gpu_milli if request.num_gpu else 0
        decision.placement = Placement(request.name, self.state.nodes[best].name, cards, milli)
        decision.score = score
        return decision

    def schedule(
        self, request: Request, nodes: Sequence[int] | None = None, *, exclude: Collection[int] = ()
    ) -> Decision:
        """Choose a placement for ``request`` and commit it to the state when there is one."""
        decision = self.decide(request, nodes, exclude=exclude)
        if decision.placement is not None:
            self.commit(decision.request, decision.placement)
        return decision

    def transaction(self) -> Transaction:
        """A transaction on this scheduler's state that tells the profile's reserve plugins of every change."""
        return Transaction(self.state, tuple(self.profile.reservers))

    def commit(self, request: Request, placement: Placement) -> None:
        """Allocate ``placement`` for ``request`` in the state and tell the reserve plugins."""
        with self.transaction() as tx:
            tx.allocate(request, placement)
            tx.commit()

    def release(self, name: str) -> Allocation:
        """Give back what request ``name`` holds and tell the reserve plugins (``unreserve``)."""
        with self.transaction() as tx:
            allocation = tx.evict(name)
            tx.commit()
        return allocation

    # ---- mechanism -------------------------------------------------------------------------------------

    def _feasible(self, ctx: CycleContext, decision: Decision, candidates: list[int]) -> list[int]:
        """The exhaustive path: every filter over every candidate node."""
        for flt in self.profile.filters:
            if flt.name in ctx.skipped:
                continue
            kept = flt.filter(ctx, candidates)
            if len(kept) != len(candidates):
                decision.reasons[flt.name] = len(candidates) - len(kept)
            candidates = kept
            if not candidates:
                return candidates
        if not candidates:
            decision.reasons["no nodes"] = 1
        return candidates

    def _excluded(self, ctx: CycleContext, nodes: Sequence[int] | None, exclude: Collection[int]) -> Set[int] | None:
        """The nodes this cycle leaves out when the indexed path applies to it, else ``None``.

        It applies when the profile does not choose at random, every filter and scorer of the cycle declares
        ``node_local``, and the cycle looks at every node but a few: ``nodes`` is ``None`` (or all nodes but
        at most :data:`MAX_EXCLUDED`, each once) and ``exclude`` names at most that many.
        """
        profile = self.profile
        if profile.random_choice or len(exclude) > MAX_EXCLUDED:
            return None
        skipped = ctx.skipped
        for plugin in (*profile.filters, *(ws.plugin for ws in profile.scorers)):
            if plugin.name not in skipped and getattr(plugin, "node_local", False) is not True:
                return None
        n = len(self.state)
        if nodes is None:
            if not exclude:
                return _NONE_EXCLUDED
            excluded = {i for i in exclude if 0 <= i < n}
            return excluded if len(excluded) <= MAX_EXCLUDED else None
        if len(nodes) < n - MAX_EXCLUDED:
            return None
        excluded = set(range(n))
        excluded.difference_update(nodes)
        if n - len(excluded) != len(nodes):  # a duplicate or an index out of range: the exhaustive path says so
            return None
        excluded.update(i for i in exclude if 0 <= i < n)
        return excluded if len(excluded) <= MAX_EXCLUDED else None

    def _feasible_representatives(self, ctx: CycleContext, decision: Decision, excluded: Set[int]) -> list[int]:
        """The indexed path: one node per feasible class, the class member first in the node order.

        Fills ``decision.reasons`` with the same counts as the exhaustive path.
        """
        classes = self.classes()
        active = [flt for flt in self.profile.filters if flt.name not in ctx.skipped]
        # The filters by identity: a profile whose filters are replaced gets verdicts of its own.
        shape = (*(getattr(ctx.request, f) for f in _REQUEST_FIELDS), *((f.name, id(f)) for f in active))

        def evaluate(cids: list[int]) -> dict[int, int]:
            remaining = [classes.first(cid) for cid in cids]
            verdict: dict[int, int] = {}
            for k, flt in enumerate(active):
                kept = flt.filter(ctx, remaining)
                if len(kept) != len(remaining):
                    keep = set(kept)
                    for i in remaining:
                        if i not in keep:
                            verdict[classes.of[i]] = k
                remaining = kept
            for i in remaining:
                verdict[classes.of[i]] = len(active)
            return verdict

        f = classes.feasibility(shape, len(active), evaluate)
        dropped, feasible = f.dropped, f.feasible
        if excluded:
            dropped = list(dropped)
            for i in excluded:
                v = f.verdict[classes.of[i]]
                if v < f.passes:
                    dropped[v] -= 1
        for k, flt in enumerate(active):
            if dropped[k]:
                decision.reasons[flt.name] = dropped[k]
        top = classes.top
        if excluded:
            representatives = [first for cid in feasible if (first := classes.first_not_in(cid, excluded)) is not None]
        else:
            representatives = [t if (t := top[cid]) >= 0 else classes.first(cid) for cid in feasible]
        if not representatives and not active:
            decision.reasons["no nodes"] = 1
        return representatives

    @property
    def node_classes(self) -> NodeClasses | None:
        """The classes of equal nodes when a decision has built them (actions may rank nodes per class)."""
        return self._classes

    def classes(self) -> NodeClasses:
        """The equivalence classes of the state's nodes in this scheduler's node order (built on first use)."""
        if self._classes is None:
            self._classes = NodeClasses(self.state, self.tie_rank)
        return self._classes

    def _pick(self, ctx: CycleContext, candidates: list[int]) -> tuple[int, float]:
        rank = self.tie_rank
        if self.profile.random_choice:
            return candidates[self._rng.randrange(len(candidates))], 0.0
        total: list[float] | None = None
        for ws in self.profile.scorers:
            plugin = ws.plugin
            if plugin.name in ctx.skipped:
                continue
            raw = plugin.score(ctx, candidates)
            if len(raw) != len(candidates):
                raise PluginError(
                    f"score plugin {plugin.name!r} returned {len(raw)} scores for {len(candidates)} nodes"
                )
            normalized = plugin.normalize(ctx, raw)
            low, high = min(normalized), max(normalized)
            if not (low >= MIN_NODE_SCORE and high <= MAX_NODE_SCORE) or math.isnan(sum(normalized)):
                bad = next(k for k, s in enumerate(normalized) if not MIN_NODE_SCORE <= s <= MAX_NODE_SCORE)
                raise PluginError(
                    f"score plugin {plugin.name!r} gave node {self.state.nodes[candidates[bad]].name!r} "
                    f"score {normalized[bad]} after normalisation; scores must lie in 0..100"
                )
            weight = ws.weight
            if total is None:
                total = [weight * s for s in normalized] if weight != 1 else list(normalized)
            elif weight:  # t + 0 × s is t: a weight-0 scorer is range-checked but adds nothing
                total = [t + weight * s for t, s in zip(total, normalized, strict=True)]
        if total is None:
            return min(candidates, key=rank.__getitem__), 0.0
        # Highest score; among equals, the node first in the run's order.
        best_score = max(total)
        k = total.index(best_score)
        if total.count(best_score) > 1:
            k = min((j for j, t in enumerate(total) if t == best_score), key=lambda j: rank[candidates[j]])
        return candidates[k], total[k]

    def _select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None:
        for selector in self.profile.card_selectors:
            if selector.name in ctx.skipped:
                continue
            cards = selector.select_cards(ctx, node)
            if cards is not None:
                return cards
        return default_cards(self.state, ctx.request, node)


def default_cards(state: ClusterState, request: Request, node: int) -> tuple[int, ...] | None:
    """Lowest-index fully free cards for whole cards; the fullest card that fits (best fit) for a share."""
    if request.num_gpu == 0:
        return ()
    gpus = state.nodes[node].gpus
    free = state.free_gpu[node]
    free_mem = state.free_gpu_memory[node]
    fitting = [
        g
        for g in range(len(gpus))
        if free[g] >= request.gpu_milli
        and free_mem[g] >= request.gpu_memory_mib
        and state.card_usable(node, g)
        and request.allows_model(gpus[g].model)
    ]
    if request.gpu_milli == MILLI_PER_GPU or request.num_gpu > 1:
        whole = [g for g in fitting if free[g] == MILLI_PER_GPU]
        return tuple(whole[: request.num_gpu]) if len(whole) >= request.num_gpu else None
    if not fitting:
        return None
    return (min(fitting, key=lambda g: (free[g], g)),)
