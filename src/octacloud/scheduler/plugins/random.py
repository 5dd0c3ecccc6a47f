"""The published Random baseline's card choice: a uniformly random card among those that fit.

(The node is chosen uniformly among feasible nodes by the runner when the profile sets ``random_choice``.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from octacloud.scheduler.framework.api import CycleContext
from octacloud.scheduler.plugins.fit import cards_that_fit
from octacloud.scheduler.registry import Args, PluginContext


@dataclass(slots=True)
class RandomCard:
    """Card selector: a random fitting card for a share; the first fully free cards for whole cards."""

    seed: int = 0
    name: str = "random-card"
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed ^ 0x5EED)

    def select_cards(self, ctx: CycleContext, node: int) -> tuple[int, ...] | None:
        if not ctx.request.is_sharing:
            return None
        cards = cards_that_fit(ctx.state, ctx.request, node)
        return (cards[self._rng.randrange(len(cards))],) if cards else None


def build(name: str, args: Args, ctx: PluginContext) -> RandomCard:
    return RandomCard(args.integer("seed", ctx.seed), name)
