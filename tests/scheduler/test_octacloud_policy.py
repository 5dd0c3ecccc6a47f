"""octacloud's placement: exact fragmentation growth plus CPU stranding, consolidating among near-equal nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core.errors import InvalidSpecError
from octacloud.scheduler.fragmentation import TargetWorkload, WorkloadShape, node_fragmentation
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.framework.api import CycleContext, DemandObserver
from octacloud.scheduler.plugins.octacloud import ConsolidatingFragmentation, filler_sizes
from octacloud.scheduler.policies import build_profile
from tests.scheduler.helpers import check_invariants, node, place, req

ONE_CARD_4_CORES = TargetWorkload((WorkloadShape(4000, 1000, 1),), (1.0,))
MIXED = TargetWorkload(
    (WorkloadShape(1000, 600, 1), WorkloadShape(2000, 1000, 1), WorkloadShape(8000, 1000, 2)), (0.5, 0.3, 0.2)
)
SEEDS = range(8)


def _schedule(policy: str, state: ClusterState, workload: TargetWorkload, seed: int, request_: object) -> str:
    scheduler = Scheduler(state, build_profile(policy, seed=seed, workload=workload))
    decision = scheduler.decide(request_)  # type: ignore[arg-type]
    assert decision.placement is not None, decision.explain()
    return decision.placement.node


def test_cpu_heavy_pod_avoids_stranding_idle_cards() -> None:
    # 'a' has 10 cores for 2 idle cards: after a 4-core CPU-only pod only one 4-core GPU task still fits, so one
    # card is stranded. FGD asks "does one task still fit?" (yes, on both nodes) and cannot tell them apart.
    state = ClusterState([node("a", 2, cpu=10_000), node("b", 2, cpu=64_000)])
    cpu_only = req("c", 0, 0, cpu=4000)
    assert {_schedule("octacloud", state, ONE_CARD_4_CORES, s, cpu_only) for s in SEEDS} == {"b"}
    assert "a" in {_schedule("fgd", state, ONE_CARD_4_CORES, s, cpu_only) for s in SEEDS}


def test_stranding_counts_what_cpu_cannot_host() -> None:
    plugin = ConsolidatingFragmentation(ONE_CARD_4_CORES)
    assert plugin.stranded("T4", 10_000, (1000, 1000)) == 0.0  # two 4-core tasks fit
    assert plugin.stranded("T4", 6_000, (1000, 1000)) == 1000.0  # one fits; the other card is stranded
    assert plugin.stranded("T4", 3_000, (1000, 500)) == 1500.0  # none fits by CPU
    assert ConsolidatingFragmentation(ONE_CARD_4_CORES, stranding=False).stranded("T4", 0, (1000,)) == 0.0


def test_near_equal_nodes_consolidate_on_the_fuller() -> None:
    state = ClusterState([node("a", 4), node("b", 4)])
    place(state, req("x", 1000), "a", (0,))
    whole = req("p", 1000)
    assert {_schedule("octacloud", state, ONE_CARD_4_CORES, s, whole) for s in SEEDS} == {"a"}


def test_clearly_less_fragmentation_beats_consolidation() -> None:
    # A 600 share on 'a' (a card with 700 free) leaves 100 nobody can use; on the idle 'b' it leaves 400 idle that
    # the 600 and whole-card shapes cannot use either, but keeps 'a''s 700 for a 600 share. Compare exactly.
    state = ClusterState([node("a", 1), node("b", 1)])
    place(state, req("x", 300), "a", (0,))
    plugin = ConsolidatingFragmentation(MIXED, stranding=False, pairing=False)
    ctx = CycleContext(state, req("p", 600))
    raw = plugin.score(ctx, [0, 1])
    for i, score in enumerate(raw):
        before = node_fragmentation(state, i, MIXED)
        place(state, req("probe", 600), state.nodes[i].name, (0,))
        after = node_fragmentation(state, i, MIXED)
        state.release("probe")
        assert score == pytest.approx(before - after)  # the raw score is −ΔF, exactly
    normalized = plugin.normalize(ctx, raw)
    assert max(normalized) == 100.0 and min(normalized) >= 0.0
    best = 0 if raw[0] > raw[1] else 1
    assert normalized[best] == 100.0


def test_share_goes_to_the_fullest_near_equal_card() -> None:
    state = ClusterState([node("a", 3)])
    place(state, req("x", 200), "a", (0,))
    place(state, req("y", 400), "a", (1,))
    workload = TargetWorkload((WorkloadShape(1000, 100, 1),), (1.0,))  # every remainder stays usable: ΔF = 0
    decision = Scheduler(state, build_profile("octacloud", seed=3, workload=workload)).schedule(req("p", 300))
    assert decision.placement is not None and decision.placement.gpus == (1,)
    check_invariants(state)


def test_whole_node_kept_for_a_large_shape() -> None:
    # The workload has 2-card tasks: one card on the half-used 'a' keeps 'b' whole; the opposite breaks it.
    state = ClusterState([node("a", 2), node("b", 2)])
    place(state, req("x", 1000), "a", (0,))
    assert {_schedule("octacloud", state, MIXED, s, req("p", 1000)) for s in SEEDS} == {"a"}


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(InvalidSpecError, match="tolerance"):
        ConsolidatingFragmentation(MIXED, tolerance=-1.0)
    plugin = ConsolidatingFragmentation(MIXED)
    state = ClusterState([node("a")])
    with pytest.raises(InvalidSpecError, match="without its score call"):
        plugin.normalize(CycleContext(state, req("p", 500)), [0.0])


def test_profile_needs_a_workload() -> None:
    with pytest.raises(InvalidSpecError, match="target workload"):
        build_profile("octacloud", seed=0)


def test_memory_stranding_counts_what_memory_cannot_host() -> None:
    # One-card tasks of 4 cores and (median) 48 GiB: on a node with 64 GiB left only one fits.
    workload = TargetWorkload((WorkloadShape(4000, 1000, 1),), (1.0,), (48 * 1024,))
    plugin = ConsolidatingFragmentation(workload)
    assert plugin.stranded("T4", 64_000, (1000, 1000), 96 * 1024) == 0.0
    assert plugin.stranded("T4", 64_000, (1000, 1000), 64 * 1024) == 1000.0
    assert plugin.stranded("T4", 64_000, (1000, 1000)) == 0.0  # memory not given: CPU only


def test_memory_heavy_pod_avoids_stranding_idle_cards() -> None:
    # 'a' and 'b' differ only in memory. A 64 GiB pod on 'a' leaves 32 GiB: the workload's 48 GiB one-card tasks
    # can no longer use its other card. CPU alone (and FGD) cannot tell the nodes apart; 'a' comes first.
    workload = TargetWorkload((WorkloadShape(4000, 1000, 1),), (1.0,), (48 * 1024,))
    state = ClusterState([node("a", 2, memory=96 * 1024), node("b", 2, memory=256 * 1024)])
    pod = req("p", 1000, cpu=4000, memory=64 * 1024)
    assert {_schedule("octacloud", state, workload, s, pod) for s in SEEDS} == {"b"}
    assert "a" in {_schedule("fgd", state, workload, s, pod) for s in SEEDS}


def test_median_memory_of_each_shape_is_recorded() -> None:
    requests = [req(f"r{k}", 1000, cpu=4000, memory=m) for k, m in enumerate((1024, 2048, 9999))]
    workload = TargetWorkload.from_requests(requests, coverage=1.0)
    assert workload.memory_mib == (2048,)
    with pytest.raises(InvalidSpecError, match="memories"):
        TargetWorkload((WorkloadShape(4000, 1000, 1),), (1.0,), (1, 2))


def test_cpu_rich_whole_node_kept_for_the_tasks_only_it_can_host() -> None:
    # Two idle 8-card nodes: 'a' has 96 cores, 'b' 128. The workload has 8-card tasks of 88 cores (either node)
    # and of 120 cores (only 'b'). A one-card pod must break one of them. Breaking 'b' loses the 120-core tasks'
    # only home (F sees it); breaking 'a' loses nothing they could use. The stranding term used to charge 'a' for
    # the 88-core tasks' CPU although seven cards can no longer host them anyway (F counts that already), and
    # sent the pod to 'b'.
    workload = TargetWorkload(
        (WorkloadShape(4000, 1000, 1), WorkloadShape(88_000, 1000, 8), WorkloadShape(120_000, 1000, 8)),
        (0.5, 0.45, 0.05),
    )
    state = ClusterState([node("b", 8, cpu=128_000), node("a", 8, cpu=96_000)])
    pod = req("p", 1000, cpu=12_000)
    assert {_schedule("octacloud", state, workload, s, pod) for s in SEEDS} == {"a"}
    plugin = ConsolidatingFragmentation(workload)
    # seven cards left: the 8-card shapes add nothing to S on either node
    assert plugin.stranded("T4", 84_000, (0,) + (1000,) * 7) == pytest.approx(0.0)
    assert plugin.stranded("T4", 116_000, (0,) + (1000,) * 7) == pytest.approx(0.0)


PAIRS = TargetWorkload(
    (
        WorkloadShape(1000, 470, 1),
        WorkloadShape(1000, 320, 1),
        WorkloadShape(1000, 650, 1),
        WorkloadShape(1000, 1000, 1),
    ),
    (0.25, 0.25, 0.25, 0.25),
)


def test_dead_space_is_what_no_combination_of_shares_fills() -> None:
    plugin = ConsolidatingFragmentation(PAIRS)
    assert plugin.dead_space(210) == 210  # below every share size
    assert plugin.dead_space(530) == 60  # 470
    assert plugin.dead_space(680) == 30  # 650 (or 320 + 320 → 40)
    assert plugin.dead_space(360) == 40  # 320
    assert plugin.dead_space(970) == 0  # 650 + 320
    assert plugin.dead_space(1000) == 0 and plugin.dead_space(0) == 0  # a whole free card is not dead space
    assert ConsolidatingFragmentation(PAIRS, pairing=False).dead_space(210) == 0


def test_share_pairs_with_the_card_its_leftover_can_still_be_filled_on() -> None:
    # A 320 share: on 'a' (a 470 there, 530 free) it leaves 210 that no share of the workload fits (dead space
    # 60 → 210); on 'b' (a 320 there, 680 free) it leaves 360 for another 320 (dead space 30 → 40). FGD's one-task
    # measure prefers 'a' (the 530 it fills was useless to 650s and whole cards, the 360 left on 'b' is useless to
    # 470s as well), so the pairing 470 + 320 that strands 210 for good wins without D.
    state = ClusterState([node("a", 1), node("b", 1)])
    place(state, req("x", 470), "a", (0,))
    place(state, req("y", 320), "b", (0,))
    pod = req("p", 320)
    assert {_schedule("octacloud", state, PAIRS, s, pod) for s in SEEDS} == {"b"}
    assert {_schedule("fgd", state, PAIRS, s, pod) for s in SEEDS} == {"a"}
    plugin = ConsolidatingFragmentation(PAIRS, pairing=False)
    ctx = CycleContext(state, pod)
    normalized = plugin.normalize(ctx, plugin.score(ctx, [0, 1]))
    assert normalized[0] > normalized[1]  # without D: 'a'
    check_invariants(state)


def test_a_share_size_too_rare_for_the_remainders_it_alone_fills_is_no_filler() -> None:
    # The 810 share leaves 190, which only 160 fits, and 810s are ten times as frequent as 160s: a leftover that
    # only 160s could fill stays idle. 470 fills the 530 its own pairs leave, so it counts.
    workload = TargetWorkload(
        (WorkloadShape(1000, 810, 1), WorkloadShape(1000, 470, 1), WorkloadShape(1000, 160, 1)), (0.5, 0.45, 0.05)
    )
    assert filler_sizes(workload) == (470, 810)
    plugin = ConsolidatingFragmentation(workload)
    assert plugin.dead_space(190) == 190 and plugin.dead_space(530) == 60
    assert filler_sizes(PAIRS) == (320, 470, 650)


def test_every_share_size_of_the_trace_is_a_filler_not_only_the_covered_shapes() -> None:
    requests = [req(f"r{k}", 470) for k in range(40)] + [req("rare", 330, cpu=7000)]
    workload = TargetWorkload.from_requests(requests)  # 95 % coverage: the 330 shape is left out
    assert [s.gpu_milli for s in workload.shapes] == [470]
    assert workload.share_sizes == ((330, pytest.approx(1 / 41)), (470, pytest.approx(40 / 41)))
    assert filler_sizes(workload) == (330, 470)
    assert ConsolidatingFragmentation(workload).dead_space(670) == 10  # 330 + 330


def _restricted_workload(restricted: int, free: int) -> TargetWorkload:
    """``restricted`` one-card requests that may use only T4 and ``free`` that may use any model."""
    requests = [req(f"t{k}", 1000, models=("T4",)) for k in range(restricted)]
    return TargetWorkload.from_requests(requests + [req(f"a{k}", 1000) for k in range(free)])


def test_restricted_demand_is_recorded_per_model_set() -> None:
    workload = _restricted_workload(3, 1)
    ((models, share, moment),) = workload.restricted_demand
    assert (models, share, moment) == (frozenset({"T4"}), 0.75, 1000.0)
    assert TargetWorkload.from_requests([req("a", 500), req("b", 1000)]).restricted_demand == ()
    shapes = TargetWorkload((WorkloadShape(1000, 500, 1, frozenset({"A10"})), WorkloadShape(1000, 1000, 2)), (0.5, 0.5))
    assert shapes.restricted_demand == ((frozenset({"A10"}), pytest.approx(500 / 2500), 500.0),)


def test_an_unrestricted_pod_leaves_the_scarce_model_to_the_requests_only_it_can_take() -> None:
    # 4 % of the workload's GPU demand may use only T4, and the fleet has 2 T4 cards of 42: about 1.7 cards of
    # T4-only demand is still to come for 2 free. F's credit for keeping T4 free (40 milli) is within the
    # tolerance, so consolidation alone takes the smaller T4 node; R charges the T4 card ~0.4 of a card.
    state = ClusterState([*(node(f"g{k}", 8, model="G2") for k in range(5)), node("t", 2, model="T4")])
    workload = _restricted_workload(2, 48)
    pod = req("p", 1000)
    assert {_schedule("octacloud", state, workload, s, pod) for s in SEEDS} <= {f"g{k}" for k in range(5)}
    plugin = ConsolidatingFragmentation(workload, scarcity=False)
    ctx = CycleContext(state, pod)
    normalized = plugin.normalize(ctx, plugin.score(ctx, list(range(6))))
    assert normalized[5] == 100.0 > normalized[0]  # without R: the T4 node
    costs = ConsolidatingFragmentation(workload).scarcity_costs(state)
    assert set(costs) == {"T4"} and 0.3 < costs["T4"] < 0.5
    # a restricted pod still goes to T4; with little restricted demand the T4 node is no longer protected
    assert {_schedule("octacloud", state, workload, s, req("r", 1000, models=("T4",))) for s in SEEDS} == {"t"}
    light = _restricted_workload(1, 200)
    assert ConsolidatingFragmentation(light).scarcity_costs(state)["T4"] < 0.01
    assert {_schedule("octacloud", state, light, s, pod) for s in SEEDS} == {"t"}
    check_invariants(state)


def test_no_restricted_demand_no_scarcity_cost() -> None:
    state = ClusterState([node("g", 4, model="G2"), node("t", 2, model="T4")])
    assert ConsolidatingFragmentation(MIXED).scarcity_costs(state) == {}


PROFILE_WITH_M = """name: octacloud-m
plugins:
  - resource-fit
  - plugin: octacloud
    weight: 1
    args: {multi-card-scarcity: true}
"""


def test_multi_card_demand_is_recorded_per_class_rare_ones_included() -> None:
    requests = [req(f"s{k}", 500) for k in range(98)] + [req("m", 1000, 8, cpu=88_000), req("n", 1000, 8, cpu=88_000)]
    workload = TargetWorkload.from_requests(requests)
    assert all(s.num_gpu == 1 for s in workload.shapes)  # the eight-card shape is below the 95 % coverage
    ((cards, cpu, models, memory, share),) = workload.multi_demand
    assert (cards, cpu, models, memory) == (8, 88_000, frozenset(), 1024)
    assert share == pytest.approx(16_000 / (98 * 500 + 16_000))


def test_the_last_whole_nodes_are_kept_for_the_eight_card_requests_to_come(tmp_path: Path) -> None:
    # 59 % of the GPU demand is eight-card requests; one idle 8-card node and a half-used one are left: about 7
    # cards of eight-card demand are expected for one copy hosted (8 cards), so a one-card pod that breaks the
    # idle node risks an eight-card request with chance ~0.43 (M ≈ 3,400 milli-GPU) and goes beside the used cards.
    state = ClusterState([node("a", 8, cpu=96_000), node("c", 8, cpu=96_000)])
    place(state, req("x", 1000, 4, cpu=8000), "c", (0, 1, 2, 3))
    requests = [req(f"w{k}", 1000) for k in range(56)] + [req(f"e{k}", 1000, 8, cpu=16_000) for k in range(10)]
    workload = TargetWorkload.from_requests(requests)
    plugin = ConsolidatingFragmentation(workload, whole_cards=True)
    (cost,) = plugin.whole_card_costs(state)
    assert 0.35 * 8000 < cost < 0.5 * 8000
    assert plugin.copies(state.signature[0]) == (1,) and plugin.copies(state.signature[1]) == (0,)
    path = tmp_path / "m.yaml"
    path.write_text(PROFILE_WITH_M)
    for seed in SEEDS:
        decision = Scheduler(state, build_profile(str(path), seed=seed, workload=workload)).decide(req("p", 1000))
        assert decision.placement is not None and decision.placement.node == "c"
    assert ConsolidatingFragmentation(workload, whole_cards=False).whole_card_costs(state) == ()
    assert {_schedule("octacloud", state, workload, s, req("p", 1000)) for s in SEEDS} == {"c"}  # on by default
    plenty = ClusterState([node(f"n{k}", 8, cpu=96_000) for k in range(60)])
    assert plugin.whole_card_costs(plenty) == ()  # 60 copies for ~35 expected: negligible, no cost
    check_invariants(state)


def test_whole_card_totals_follow_the_state_incrementally() -> None:
    state = ClusterState([node("a", 8, cpu=96_000), node("b", 8, cpu=96_000)])
    workload = TargetWorkload.from_requests([req("w", 1000), req("e", 1000, 8, cpu=16_000)])
    plugin = ConsolidatingFragmentation(workload, whole_cards=True)
    plugin.whole_card_costs(state)
    assert plugin._demand.copies_total == [2] and plugin._demand.free_total == 16_000
    place(state, req("x", 300), "a", (5,))
    plugin.whole_card_costs(state)
    assert plugin._demand.copies_total == [1] and plugin._demand.free_total == 15_700
    state.release("x")
    plugin.whole_card_costs(state)
    assert plugin._demand.copies_total == [2] and plugin._demand.free_total == 16_000


def test_eight_card_requests_waiting_in_the_queue_raise_the_cost_of_breaking_a_whole_node() -> None:
    # 60 idle 8-card nodes for ~35 expected copies: negligible from the workload alone; 60 eight-card requests
    # waiting in the loop's queue make breaking one of them cost almost its 8 cards (the live demand).
    plenty = ClusterState([node(f"n{k}", 8, cpu=96_000) for k in range(60)])
    requests = [req(f"w{k}", 1000) for k in range(56)] + [req(f"e{k}", 1000, 8, cpu=16_000) for k in range(10)]
    plugin = ConsolidatingFragmentation(TargetWorkload.from_requests(requests), whole_cards=True)
    assert isinstance(plugin, DemandObserver)
    assert plugin.whole_card_costs(plenty) == ()
    waiting = [req(f"q{k}", 1000, 8, cpu=16_000) for k in range(60)] + [req("one", 1000), req("share", 500)]
    plugin.observe_queue(waiting)
    (cost,) = plugin.whole_card_costs(plenty)
    assert 0.9 * 8000 < cost <= 8000
    plugin.observe_queue([req("one", 1000), req("other-models", 1000, 8, cpu=16_000, models=["V100"])])
    assert plugin.whole_card_costs(plenty) == ()  # nothing of the class waits any more


def _churn_state() -> ClusterState:
    # 'a' is idle but a CPU-only pod holds 40 of its 96 cores: 56 cores host three 16-core one-card tasks, so
    # five of its eight cards are stranded for that shape, and a light pod there "rescues" one of them (S falls by
    # ~1000 × p). 'b' has one card left beside seven busy ones. 'a' still hosts a 32-core eight-card task.
    state = ClusterState([node("a", 8, cpu=96_000), node("b", 8, cpu=96_000)])
    place(state, req("cpu-only", 0, cpu=40_000), "a")
    for k in range(7):
        place(state, req(f"busy{k}", 1000), "b", (k,))
    return state


CHURN_WORKLOAD = TargetWorkload.from_requests(
    [req(f"w{k}", 1000, cpu=16_000) for k in range(40)] + [req(f"e{k}", 1000, 8, cpu=32_000) for k in range(2)]
)


def _return_capacity(scheduler: Scheduler, state: ClusterState) -> None:
    """A one-card pod starts on 'a' and leaves again (a decision sees it, the next sees it gone)."""
    place(state, req("brief", 1000), "a", (7,))
    scheduler.decide(req("look", 1000))
    state.release("brief")


def test_once_capacity_comes_back_a_whole_node_is_not_broken_for_the_stranding_it_rescues(tmp_path: Path) -> None:
    # Filling a trace (nothing ever leaves) the stranding credit sends a light pod to the idle node 'a', as before.
    # Under churn 'a''s CPU comes back as its work leaves, while its eight whole cards, once broken, come back only
    # when all of it has left: after capacity has come back once, the pod goes beside the busy cards on 'b'.
    off = tmp_path / "off.yaml"
    off.write_text(PROFILE_WITH_M.replace("multi-card-scarcity: true", "churn-aware: false"))
    for seed in SEEDS:
        state = _churn_state()
        scheduler = Scheduler(state, build_profile("octacloud", seed=seed, workload=CHURN_WORKLOAD))
        first = scheduler.decide(req("p", 1000))
        assert first.placement is not None and first.placement.node == "a"
        _return_capacity(scheduler, state)
        again = scheduler.decide(req("p", 1000))
        assert again.placement is not None and again.placement.node == "b", again.explain()
        state = _churn_state()
        unaware = Scheduler(state, build_profile(str(off), seed=seed, workload=CHURN_WORKLOAD))
        _return_capacity(unaware, state)
        kept = unaware.decide(req("p", 1000))
        assert kept.placement is not None and kept.placement.node == "a"
        check_invariants(state)


def test_once_capacity_comes_back_a_share_no_longer_pairs_for_its_leftover() -> None:
    # The pairing scenario above: D sends the 320 beside the 320 ('b'); once capacity has come back, the 470 next
    # to 'a''s remainder is expected to leave too, and the 320 goes where F and S put it ('a'), as FGD does.
    state = ClusterState([node("a", 1), node("b", 1), node("c", 1)])
    place(state, req("x", 470), "a", (0,))
    place(state, req("y", 320), "b", (0,))
    plugin = ConsolidatingFragmentation(PAIRS)
    pod = req("p", 320)
    ctx = CycleContext(state, pod)
    before = plugin.normalize(ctx, plugin.score(ctx, [0, 1]))
    assert before[1] > before[0] and not plugin.capacity_returned(state)
    place(state, req("z", 650), "c", (0,))
    plugin.score(CycleContext(state, req("look", 100)), [2])
    state.release("z")
    ctx = CycleContext(state, pod)
    after = plugin.normalize(ctx, plugin.score(ctx, [0, 1]))
    assert after[0] > after[1] and plugin.capacity_returned(state)
    assert plugin.capacity_returned(ClusterState([node("a", 1)])) is False  # a new state starts unaware


def test_once_capacity_comes_back_near_equal_nodes_are_told_apart_by_the_share_cards_remainder() -> None:
    # 'a' (one card, 600 free) and 'b' (520 free beside a whole card) are within the tolerance for a 500 share.
    # Filling, the fuller node wins (consolidation: 'a', 100 left on its card); once capacity has come back (D is
    # off), the card the share fills best does ('b', 20 left), as FGD's measure tends to.
    workload = TargetWorkload.from_requests(
        [req(f"s{k}", 500) for k in range(10)] + [req(f"w{k}", 1000) for k in range(10)]
    )
    state = ClusterState([node("a", 1), node("b", 2)])
    place(state, req("x", 400), "a", (0,))
    place(state, req("y", 480), "b", (0,))
    plugin = ConsolidatingFragmentation(workload)
    ctx = CycleContext(state, req("p", 500))
    assert plugin.normalize(ctx, plugin.score(ctx, [0, 1])) == [100.0, 0.0]
    place(state, req("z", 1000), "b", (1,))
    plugin.score(CycleContext(state, req("look", 100)), [0])
    state.release("z")
    ctx = CycleContext(state, req("p", 500))
    assert plugin.normalize(ctx, plugin.score(ctx, [0, 1])) == [0.0, 100.0] and plugin.capacity_returned(state)
    unaware = ConsolidatingFragmentation(workload, churn_aware=False)
    ctx = CycleContext(state, req("p", 500))
    assert unaware.normalize(ctx, unaware.score(ctx, [0, 1])) == [100.0, 0.0]


def test_once_capacity_comes_back_stranding_speaks_only_within_the_tolerance() -> None:
    # One-card 16-core tasks only (no multi-card class). 'a' is idle but a CPU-only pod holds 56 of its 96 cores:
    # 40 cores host two tasks, so two of its four cards are stranded, and a light pod there "rescues" one (ΔS =
    # −1000); 'b' has one card left beside three busy ones (ΔS = 0). F sees no difference. Filling a trace, S sends
    # the pod to 'a'; once capacity has come back, 'a''s CPU is expected to come back too, S counts at most the
    # tolerance, and the pod goes to the fuller node.
    workload = TargetWorkload((WorkloadShape(16_000, 1000, 1),), (1.0,))
    state = ClusterState([node("a", 4, cpu=96_000), node("b", 4, cpu=96_000), node("c", 1)])
    place(state, req("cpu-only", 0, cpu=56_000), "a")
    for k in range(3):
        place(state, req(f"busy{k}", 1000), "b", (k,))
    plugin = ConsolidatingFragmentation(workload)
    pod = req("p", 1000, cpu=1000)
    ctx = CycleContext(state, pod)
    raw = plugin.score(ctx, [0, 1])
    assert raw[0] - raw[1] == pytest.approx(1000.0)  # −Δ: S's rescue on 'a'
    before = plugin.normalize(ctx, raw)
    assert before[0] > before[1] and not plugin.capacity_returned(state)
    place(state, req("brief", 1000), "c", (0,))
    plugin.score(CycleContext(state, req("look", 1000)), [1])
    state.release("brief")
    ctx = CycleContext(state, pod)
    raw = plugin.score(ctx, [0, 1])
    assert raw[0] - raw[1] == pytest.approx(50.0)  # clipped to the tolerance
    after = plugin.normalize(ctx, raw)
    assert after[1] > after[0] and plugin.capacity_returned(state)
    unaware = ConsolidatingFragmentation(workload, churn_aware=False)
    ctx = CycleContext(state, pod)
    kept = unaware.normalize(ctx, unaware.score(ctx, [0, 1]))
    assert kept[0] > kept[1]
