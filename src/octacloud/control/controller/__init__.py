"""The controller: reconciles desired deployments with running replicas, by responsibility:

* :mod:`.core` — the operator's API (deploy, scale, undeploy, rollouts, the fleet's news) and the loop that
  survives I/O errors and reports when it stalls;
* :mod:`.deploys` — the one deploy path: checks, sizing, quotas, revisions;
* :mod:`.health` — probes, failures and restarts with back-off;
* :mod:`.reconcile` — desired vs actual: counts (:mod:`.autoscale` moves them), rolling updates;
* :mod:`.executor` — the scheduler's re-evaluation pass (place → preempt → defragment) and its operations;
* :mod:`.replacement` — make-before-break (moves and rolling-update steps) as one state machine with one owner,
  resumed or undone after a restart;
* :mod:`.adoption` — taking over from the previous controller at start;
* :mod:`.fleet_changes` — nodes and cards failing, recovering and joining;
* :mod:`.lifecycle` — the mechanism: launching, routing, draining and stopping, never blocking the event loop;
* :mod:`.reservations` — the fleet's nodes and the slices replicas hold in the scheduler's state;
* :mod:`.events`, :mod:`.state` (the store in memory, written behind), :mod:`.contracts` (settings and seams).
"""

from octacloud.control.controller.contracts import ControllerSettings, FootprintSource, NodeChange, Probe, Prober
from octacloud.control.controller.core import Controller, LoopHealth

__all__ = ["Controller", "ControllerSettings", "FootprintSource", "LoopHealth", "NodeChange", "Probe", "Prober"]
