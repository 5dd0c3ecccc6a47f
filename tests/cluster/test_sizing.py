"""Deploy, scale and auto-sizing refuse what this fleet could never place, naming the largest slice it gives;
auto-sizing says why it chose a size. The 80 % card-memory rule and the 20 % failover reserve apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.control.controller import Controller
from octacloud.control.deployments import DeploymentSpec
from octacloud.control.launcher import LocalProcessLauncher
from octacloud.control.probes import HttpProber
from octacloud.control.sizing import FleetCapacity, ModelFootprint, plan_size, reserve_percent, size_deployment
from octacloud.control.store import StateStore
from octacloud.core import Gpu, Node
from octacloud.core.clock import ManualClock
from octacloud.core.errors import InvalidSpecError
from octacloud.gateway.routing import RouteTable
from octacloud.scheduler.framework.runner import Scheduler
from octacloud.scheduler.framework.state import ClusterState
from octacloud.scheduler.policies import PRODUCT_DEFAULT, build_profile, slice_prior

from .conftest import write_linear_model

MIB = 1024 * 1024


def fleet(nodes: int, cards: int, memory_mib: int = 1024) -> list[Node]:
    return [Node(f"n{i}", 8000, 65536, tuple(Gpu(g, "cpu", memory_mib) for g in range(cards))) for i in range(nodes)]


ONE_CARD = FleetCapacity.of(fleet(1, 1), reserve_percent=20)
DEMO = FleetCapacity.of(fleet(2, 4), reserve_percent=20)
BERT = ModelFootprint(weights_bytes=420 * MIB, samples_per_second_per_card=16.0)


@pytest.mark.parametrize(
    ("capacity", "largest"),
    [
        (ONE_CARD, 6),  # 80 % of one card: 6 octants (750 milli); a whole card would eat the reserve
        (FleetCapacity.of(fleet(1, 1)), 8),  # no reserve: the whole card
        (FleetCapacity.of(fleet(1, 2), 20), 8),  # one card of two (1000 <= 1600 milli)
        (DEMO, 32),  # four whole cards of one node (4000 <= 6400 milli)
        (FleetCapacity.of(fleet(4, 2), 20), 16),  # a node has two cards
        (FleetCapacity.of([]), 0),
    ],
)
def test_largest_slice(capacity: FleetCapacity, largest: int) -> None:
    assert capacity.largest_octants == largest


@pytest.mark.parametrize(
    ("capacity", "octants", "memory", "fit"),
    [
        (DEMO, 1, 0, 51),  # 64 octants, of which 6400 // 125 = 51 may be held by normal work
        (DEMO, 4, 0, 12),  # two per card, 16 in all; 6400 // 500 = 12
        (DEMO, 8, 0, 6),
        (DEMO, 16, 0, 3),  # two pairs per node, but only 6400 // 2000 = 3 within the reserve
        (DEMO, 1, 400, 16),  # memory: two 400 MiB models per 1024 MiB card
        (ONE_CARD, 4, 0, 1),
    ],
)
def test_replicas_that_fit(capacity: FleetCapacity, octants: int, memory: int, fit: int) -> None:
    assert capacity.replicas_that_fit(octants, memory) == fit


@pytest.mark.parametrize(
    ("capacity", "octants", "replicas", "memory", "message"),
    [
        (
            ONE_CARD,
            16,
            1,
            0,
            r"16 octant\(s\) .*never be placed: .*1 card\(s\), 20 % kept for failover\) gives at most 6",
        ),
        (ONE_CARD, 8, 1, 0, "gives at most 6 octant"),
        (ONE_CARD, 4, 2, 0, r"2 replica\(s\) × 4 octant\(s\) can never be placed: at most 1 such"),
        (DEMO, 1, 52, 0, r"at most 51 such replica\(s\) fit"),
        (DEMO, 8, 1, 900, r"needs 900 MiB but a model may use at most 80 % .* \(819 of 1024 MiB"),
        (DEMO, 2, 1, 300, r"2 octant\(s\) of a 1024 MiB card hold 256 MiB; use --octants 3 or more"),
        (FleetCapacity.of([]), 1, 1, 0, "no cards"),
    ],
)
def test_what_can_never_be_placed_is_refused(
    capacity: FleetCapacity, octants: int, replicas: int, memory: int, message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        capacity.check("d", octants, replicas, memory)


def test_what_fits_passes() -> None:
    DEMO.check("d", 1, 51)
    DEMO.check("d", 32, 1)
    ONE_CARD.check("d", 6, 1)


def test_auto_sizing_grows_slices_only_to_the_largest_the_fleet_gives_and_then_refuses() -> None:
    spec = DeploymentSpec("bert", "bert_base", octants=None, target_qps=50, max_replicas=4)
    with pytest.raises(InvalidSpecError, match=r"4 replica\(s\) × 6 octant\(s\) can never be placed.*at most 6 oct"):
        plan_size(spec, lambda: BERT, ONE_CARD)
    sizing = plan_size(spec, lambda: BERT, DEMO)
    assert (sizing.octants, sizing.replicas) == (7, 4)  # 4 × 7 × 2/s = 56 >= 50
    for part in ("needs 420 MiB", "2.0 samples/s per octant", "target 50 req/s", "4 replica(s) × 7 octant(s)"):
        assert part in sizing.reason


def test_auto_sizing_says_when_the_target_cannot_be_met_within_max_replicas() -> None:
    sizing = size_deployment(BERT, 1024, target_qps=500, min_replicas=1, max_replicas=2)
    assert (sizing.octants, sizing.replicas) == (8, 2)
    assert "short of the target: it needs 32" in sizing.reason


def test_auto_sizing_without_a_target_or_profile_says_so() -> None:
    assert "no --target-qps" in size_deployment(BERT, 1024, target_qps=None, min_replicas=1, max_replicas=1).reason
    bare = ModelFootprint(weights_bytes=10 * MIB)
    assert "no profile" in size_deployment(bare, 1024, target_qps=5, min_replicas=1, max_replicas=1).reason


def test_high_priority_work_may_count_the_reserve() -> None:
    profile = build_profile(PRODUCT_DEFAULT, seed=0, workload=slice_prior(), rules=True)
    assert reserve_percent(profile, 0) == 20
    assert reserve_percent(profile, 100) == 0
    assert reserve_percent(build_profile(PRODUCT_DEFAULT, seed=0, workload=slice_prior()), 0) == 0


def controller(tmp_path: Path, nodes: list[Node]) -> Controller:
    repo = tmp_path / "models"
    write_linear_model(repo)
    profile = build_profile(PRODUCT_DEFAULT, seed=0, workload=slice_prior(), rules=True)
    return Controller(
        store=StateStore.at(tmp_path / "octacloud.db"),
        nodes=nodes,
        scheduler=Scheduler(ClusterState(nodes), profile),
        launcher=LocalProcessLauncher(tmp_path / "replicas"),
        repository=repo,
        routes=RouteTable(),
        clock=ManualClock(),
        prober=HttpProber(),
        footprint=lambda model: ModelFootprint(4096),
    )


def test_the_controller_refuses_unplaceable_deploys_and_scales(tmp_path: Path) -> None:
    c = controller(tmp_path, fleet(1, 1))
    try:
        with pytest.raises(InvalidSpecError, match=r"16 octant\(s\) per replica can never be placed"):
            c.deploy(DeploymentSpec("big", "linear", octants=16))
        with pytest.raises(InvalidSpecError, match=r"at most 6 octant"):
            c.deploy(DeploymentSpec("card", "linear", octants=8))
        assert c.store.deployments() == []  # nothing was stored
        c.deploy(DeploymentSpec("lin", "linear", octants=2, max_replicas=5))
        c.scale("lin", 3)  # 750 milli of the 800 normal work may hold
        with pytest.raises(InvalidSpecError, match=r"4 replica\(s\) × 2 octant\(s\) can never be placed"):
            c.scale("lin", 4)
        assert c.store.get_deployment("lin").replicas == 3
        c.deploy(DeploymentSpec("vip", "linear", octants=8, priority=100))  # may use the reserve
    finally:
        c.store.close()
