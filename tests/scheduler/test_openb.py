"""The policies on the real openb fleet (a slice of the default trace, to stay fast)."""

from __future__ import annotations

import pytest

from octacloud.scheduler.fragmentation import FragmentationTracker, TargetWorkload, node_fragmentation
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.policies import POLICY_IDS, build_profile
from octacloud.sim.protocol import inflate
from octacloud.sim.traces import read_nodes, read_pods
from tests.scheduler.helpers import check_invariants, require_traces

PODS = 1500


@pytest.mark.traces
@pytest.mark.parametrize("policy", list(POLICY_IDS))
def test_policies_on_the_openb_fleet(policy: str) -> None:
    folder = require_traces()
    nodes = read_nodes(folder / "openb_node_list_gpu_node.csv")
    pods = [p.request for p in read_pods(folder / "openb_pod_list_default.csv")]
    workload = TargetWorkload.from_requests(pods)
    assert len(workload.shapes) == 35  # the default trace's 95 % coverage
    state = ClusterState(nodes)
    requests = inflate(pods, seed=42, tune=1.3, capacity_milli=state.total_gpu_milli)[:PODS]
    scheduler = Scheduler(state, build_profile(policy, seed=42, workload=workload))
    tracker = FragmentationTracker(state, workload)
    placed = 0
    for r in requests:
        decision = scheduler.schedule(r)
        if decision.placement is not None:
            placed += 1
            tracker.update(state.node_index(decision.placement.node))
    check_invariants(state)
    assert placed == PODS  # the cluster is far from full after 1,500 of ~10,800 pods
    exact = sum(node_fragmentation(state, i, workload) for i in range(len(state)))
    assert tracker.total == pytest.approx(exact)
