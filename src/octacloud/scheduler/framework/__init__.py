"""Scheduling mechanism: plugin contracts, the runner, cluster state and transactions."""

from octacloud.scheduler.framework.api import (
    SUCCESS,
    CardSelector,
    Code,
    CycleContext,
    DemandObserver,
    FilterPlugin,
    Plugin,
    PreFilterPlugin,
    ReservePlugin,
    ScorePlugin,
    Status,
    identity_normalize,
    min_max_normalize,
)
from octacloud.scheduler.framework.runner import (
    Decision,
    PluginError,
    Profile,
    Scheduler,
    WeightedScorer,
    default_cards,
)
from octacloud.scheduler.framework.state import Allocation, ClusterState, NodeSignature
from octacloud.scheduler.framework.transaction import Operation, Transaction

__all__ = [
    "SUCCESS",
    "Allocation",
    "CardSelector",
    "ClusterState",
    "Code",
    "CycleContext",
    "Decision",
    "DemandObserver",
    "FilterPlugin",
    "NodeSignature",
    "Operation",
    "Plugin",
    "PluginError",
    "PreFilterPlugin",
    "Profile",
    "ReservePlugin",
    "Scheduler",
    "ScorePlugin",
    "Status",
    "Transaction",
    "WeightedScorer",
    "default_cards",
    "identity_normalize",
    "min_max_normalize",
]
