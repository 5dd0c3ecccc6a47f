"""The pure domain: integer units, nodes, GPUs, requests, placements, errors and the clock.

No I/O, no asyncio, no third-party imports.
"""

from octacloud.core.clock import Clock, ManualClock, SystemClock
from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError, UnschedulableError
from octacloud.core.model import Gpu, Health, Node, Placement, Request
from octacloud.core.units import (
    MILLI_PER_GPU,
    MILLI_PER_OCTANT,
    OCTANTS_PER_GPU,
    milli_to_octants,
    octants_to_milli,
)

__all__ = [
    "MILLI_PER_GPU",
    "MILLI_PER_OCTANT",
    "OCTANTS_PER_GPU",
    "Clock",
    "Gpu",
    "Health",
    "InvalidSpecError",
    "ManualClock",
    "Node",
    "NotFoundError",
    "OctacloudError",
    "Placement",
    "Request",
    "SystemClock",
    "UnschedulableError",
    "milli_to_octants",
    "octants_to_milli",
]
