"""The controller: reconciles desired deployments with running replicas, by responsibility:

* :mod:`.core` — the operator's API (deploy, scale, undeploy, rollout status/undo) and the loop that survives
  I/O errors and reports when it stalls;
* :mod:`.health` — probes, failures and restarts with back-off;
* :mod:`.reconcile` — desired vs actual (counts, autoscaling, rolling updates), then the scheduler's
  re-evaluation loop (place → preempt → defragment) over the cloud's cluster state;
* :mod:`.executor` — carrying out the loop's operations through the launcher: start, drain-and-stop, and
  make-before-break moves and replacements, never blocking the gateway's event loop;
* :mod:`.world` — the seams (store, launcher, prober, clock, routes) and settings they share.
"""

from octacloud.control.controller.core import Controller, LoopHealth
from octacloud.control.controller.world import ControllerSettings, FootprintSource, NodeChange, Probe, Prober

__all__ = ["Controller", "ControllerSettings", "FootprintSource", "LoopHealth", "NodeChange", "Probe", "Prober"]
