"""Integer resource units.

Capacity accounting never uses floats: a card is 1000 milli-GPU, the selling unit (an *octant*) is 125
milli-GPU, memory is counted in MiB and CPU in milli-cores.
"""

from __future__ import annotations

from typing import Final

MILLI_PER_GPU: Final = 1000
"""One whole card."""

MILLI_PER_OCTANT: Final = 125
"""The product's smallest allocatable unit: one eighth of a card."""

OCTANTS_PER_GPU: Final = MILLI_PER_GPU // MILLI_PER_OCTANT

MILLI_CPU_PER_CORE: Final = 1000

MAX_MODEL_MEMORY_PERCENT: Final = 80
"""A single model may use at most this share of one card's memory (the design's rule)."""

DEFAULT_HEADROOM_PERCENT: Final = 20
"""Fleet GPU capacity that normal-priority work may not take: kept for failover."""


def octants_to_milli(octants: int) -> int:
    """Milli-GPU in ``octants`` octants."""
    if octants < 0:
        raise ValueError(f"octants must be >= 0, got {octants}")
    return octants * MILLI_PER_OCTANT


def milli_to_octants(milli: int) -> int:
    """The number of octants needed to hold ``milli`` milli-GPU (rounded up)."""
    if milli < 0:
        raise ValueError(f"milli-GPU must be >= 0, got {milli}")
    return -(-milli // MILLI_PER_OCTANT)


def round_up_to_octant(milli: int) -> int:
    """``milli`` rounded up to a whole number of octants (the product's minimum unit)."""
    return octants_to_milli(milli_to_octants(milli))


def max_model_memory_mib(card_memory_mib: int) -> int:
    """The most memory one model may use on a card of ``card_memory_mib`` (the 80 % rule)."""
    return card_memory_mib * MAX_MODEL_MEMORY_PERCENT // 100


def gib_to_mib(gib: int) -> int:
    return gib * 1024
