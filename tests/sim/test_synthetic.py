"""Churn workload specs: parsing with clear errors, seeded determinism, offered load."""

from __future__ import annotations

import math

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Request
from octacloud.sim.synthetic import (
    Lifetime,
    PoissonArrivals,
    offered_load,
    parse_arrivals,
    parse_lifetime,
    synthetic_arrivals,
)

SHAPES = [Request("s", num_gpu=1, gpu_milli=500), Request("w", num_gpu=1, gpu_milli=1000)]


def test_parse_good_specs() -> None:
    assert parse_arrivals("poisson:0.5") == PoissonArrivals(0.5)
    assert parse_lifetime("lognormal:7,1.5") == Lifetime("lognormal", 7.0, 1.5)
    assert parse_lifetime("exponential:600") == Lifetime("exponential", 600.0)
    assert parse_lifetime("fixed:30") == Lifetime("fixed", 30.0)
    assert str(parse_lifetime("lognormal:7,1.5")) == "lognormal:7,1.5"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("poisson", "expected poisson:RATE"),
        ("poisson:-1", "rate must be > 0"),
        ("poisson:x", "not a list of numbers"),
        ("uniform:3", "expected poisson:RATE"),
    ],
)
def test_bad_arrivals(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_arrivals(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lognormal:7", "expected 2 number"),
        ("lognormal:7,-1", "SIGMA must be >= 0"),
        ("fixed:0", "must be > 0"),
        ("weibull:1,2", "expected lognormal"),
        ("exponential:inf", "finite"),
    ],
)
def test_bad_lifetimes(text: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_lifetime(text)


def test_arrivals_are_seeded_ordered_unique_and_bounded() -> None:
    spec, life = PoissonArrivals(2.0), Lifetime("lognormal", 3.0, 0.5)
    a = list(synthetic_arrivals(SHAPES, spec, life, seed=7, until=100.0))
    b = list(synthetic_arrivals(SHAPES, spec, life, seed=7, until=100.0))
    c = list(synthetic_arrivals(SHAPES, spec, life, seed=8, until=100.0))
    assert a == b and a != c
    times = [x.time for x in a]
    assert times == sorted(times) and times[-1] < 100.0
    assert len({x.request.name for x in a}) == len(a)
    assert 140 < len(a) < 260  # rate 2/s over 100 s: 200 expected
    assert {x.request.total_gpu_milli for x in a} == {500, 1000}


def test_lognormal_mean_and_offered_load() -> None:
    life = Lifetime("lognormal", 2.0, 1.0)
    assert life.mean == pytest.approx(math.exp(2.5))
    # 0.1 req/s × 100 s × 750 milli mean = 7,500 milli of demand on 10,000 capacity.
    assert offered_load(SHAPES, PoissonArrivals(0.1), Lifetime("fixed", 100.0), 10_000) == pytest.approx(0.75)
