"""Synthetic churn workloads: Poisson arrivals of trace-shaped requests with random lifetimes.

Specs are short strings so that they fit on a command line:

* arrivals: ``poisson:RATE`` (RATE requests per simulated second, exponential inter-arrival times);
* lifetimes: ``lognormal:MU,SIGMA`` (seconds; ``MU`` and ``SIGMA`` of the underlying normal, so the median
  lifetime is ``e**MU``), ``exponential:MEAN`` or ``fixed:SECONDS``.

Request shapes are drawn uniformly with replacement from a trace. Everything is seeded: the same spec and seed
give the same arrivals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request that arrives at ``time`` (simulated seconds) and runs for ``lifetime`` seconds once placed."""

    time: float
    request: Request
    lifetime: float


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    rate: float
    """Requests per simulated second."""

    def __str__(self) -> str:
        return f"poisson:{self.rate:g}"


@dataclass(frozen=True, slots=True)
class Lifetime:
    """A lifetime distribution in simulated seconds."""

    kind: Literal["lognormal", "exponential", "fixed"]
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            return rng.lognormvariate(self.a, self.b)
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.a)
        return self.a

    @property
    def mean(self) -> float:
        if self.kind == "lognormal":
            return math.exp(self.a + self.b * self.b / 2.0)
        return self.a

    def __str__(self) -> str:
        return f"lognormal:{self.a:g},{self.b:g}" if self.kind == "lognormal" else f"{self.kind}:{self.a:g}"


def _numbers(option: str, text: str, body: str, count: int) -> list[float]:
    parts = [p.strip() for p in body.split(",")]
    if len(parts) != count:
        raise InvalidSpecError(f"{option} {text!r}: expected {count} number(s) after ':', got {len(parts)}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise InvalidSpecError(f"{option} {text!r}: {body!r} is not a list of numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise InvalidSpecError(f"{option} {text!r}: numbers must be finite")
    return values


def parse_arrivals(text: str) -> PoissonArrivals:
    """``poisson:RATE`` with RATE > 0 requests per simulated second."""
    kind, sep, body = text.partition(":")
    if kind.strip().lower() != "poisson" or not sep:
        raise InvalidSpecError(f"--arrivals {text!r}: expected poisson:RATE (requests per simulated second)")
    (rate,) = _numbers("--arrivals", text, body, 1)
    if rate <= 0:
        raise InvalidSpecError(f"--arrivals {text!r}: the rate must be > 0")
    return PoissonArrivals(rate)


def parse_lifetime(text: str) -> Lifetime:
    """``lognormal:MU,SIGMA`` (SIGMA >= 0), ``exponential:MEAN`` or ``fixed:SECONDS`` (both > 0)."""
    kind, sep, body = text.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in ("lognormal", "exponential", "fixed"):
        raise InvalidSpecError(
            f"--lifetime {text!r}: expected lognormal:MU,SIGMA, exponential:MEAN or fixed:SECONDS (seconds)"
        )
    if kind == "lognormal":
        mu, sigma = _numbers("--lifetime", text, body, 2)
        if sigma < 0:
            raise InvalidSpecError(f"--lifetime {text!r}: SIGMA must be >= 0")
        return Lifetime("lognormal", mu, sigma)
    (value,) = _numbers("--lifetime", text, body, 1)
    if value <= 0:
        raise InvalidSpecError(
            f"--lifetime {text!r}: the {'mean' if kind == 'exponential' else 'lifetime'} must be > 0"
        )
    return Lifetime("exponential" if kind == "exponential" else "fixed", value)


def synthetic_arrivals(
    shapes: Sequence[Request],
    arrivals: PoissonArrivals,
    lifetime: Lifetime,
    *,
    seed: int,
    until: float,
) -> Iterator[Arrival]:
    """Arrivals in time order up to ``until`` seconds; each request is a copy of a random shape, renamed
    ``<shape name>#<k>`` so that names are unique."""
    if not shapes:
        raise InvalidSpecError("synthetic arrivals need at least one request shape")
    rng = random.Random(seed)
    now = 0.0
    k = 0
    while True:
        now += rng.expovariate(arrivals.rate)
        if now >= until:
            return
        shape = shapes[rng.randrange(len(shapes))]
        yield Arrival(now, replace(shape, name=f"{shape.name}#{k}"), lifetime.sample(rng))
        k += 1


def offered_load(
    shapes: Sequence[Request], arrivals: PoissonArrivals, lifetime: Lifetime, capacity_milli: int
) -> float:
    """Little's law: mean GPU demand of the running work as a fraction of capacity (>1: overloaded)."""
    if not shapes or capacity_milli <= 0:
        return 0.0
    mean_milli = sum(s.total_gpu_milli for s in shapes) / len(shapes)
    return arrivals.rate * lifetime.mean * mean_milli / capacity_milli
