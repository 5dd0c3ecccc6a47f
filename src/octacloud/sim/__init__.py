"""The fleet-scale simulator: replay GPU-sharing traces under the FGD paper's protocol, or churn on simulated time.

Modules (imported on demand, so that reading a trace never loads matplotlib):

* ``traces`` — openb node and pod readers; ``protocol`` — ``inflate`` and ``replay``;
* ``metrics`` — per-pod recording and the published curve sampling;
* ``experiment`` — one run per ``RunSpec`` / ``ChurnSpec``, many in parallel processes;
* ``report`` — ``alloc.csv`` / ``frag.csv`` / ``summary.json`` and the comparison with published results;
* ``plots`` — figures; ``synthetic`` and ``churn`` — churn workloads and the event loop.

See ``docs/simulator.md``.
"""
