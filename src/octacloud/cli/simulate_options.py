"""The options of ``octacloud simulate``: each one ``typer.Option`` here (its flag, default and help), named in
the command's signature in ``cli/simulate.py``; the protocol's first, then churn mode's (``--arrivals`` on)."""

from __future__ import annotations

from typing import Any

import typer

NODES: Any = typer.Option(None, "--nodes", help="Fleet CSV (openb node list).")
PODS: Any = typer.Option(None, "--pods", help="Pods CSV; repeat for several traces.")
POLICY: Any = typer.Option("fgd", "--policy", help="Comma-separated policies, e.g. random,bestfit,fgd.")
SEEDS: Any = typer.Option("42", "--seeds", help="Seeds: 42-51, or 42,45,50-51.")
TUNE: Any = typer.Option(1.3, "--tune", help="Inflate each trace to TUNE × cluster GPU capacity.")
OUT: Any = typer.Option(None, "--out", help="Folder for the result files (created if needed).")
JOBS: Any = typer.Option(1, "--jobs", help="Runs in parallel worker processes (results do not depend on it).")
PLOTS: Any = typer.Option(True, "--plots/--no-plots", help="Write PNG figures.")
ARRIVALS: Any = typer.Option(None, "--arrivals", help="Churn mode: poisson:RATE (requests per second).")
LIFETIME: Any = typer.Option(
    "lognormal:7,1", "--lifetime", help="Churn: lognormal:MU,SIGMA, exponential:MEAN or fixed:SECONDS."
)
DURATION: Any = typer.Option(86400.0, "--duration", help="Churn: simulated seconds.")
WARMUP: Any = typer.Option(0.0, "--warmup", help="Churn: seconds left out of the time average.")
QUEUE: Any = typer.Option(False, "--queue/--no-queue", help="Churn: requests that fit nowhere wait.")
PERIOD: Any = typer.Option(5.0, "--period", help="Churn: seconds between re-evaluations of the queue.")
DEFRAG: Any = typer.Option(
    0, "--defrag", help="Churn: re-evaluate with the scheduler's loop, defragmenting with up to N moves per pass."
)
RESERVATIONS: Any = typer.Option(
    1,
    "--reservations",
    help="Churn: queued requests that may each reserve the node where they fit soonest (0: plain greedy retry).",
)
SERVE_RELEASES: Any = typer.Option(
    True,
    "--serve-releases/--no-serve-releases",
    help="Churn: capacity a departure frees goes to the queue at once (off: it waits for the next pass).",
)
GPU_MEMORY: Any = typer.Option(
    None, "--gpu-memory", help="Card memory per model for the fleet: a CSV with model,gpu_memory_mib."
)
BOUND: Any = typer.Option(True, "--bound/--no-bound", help="Compute the LP lower bound per seed.")
