"""Figures of a simulation, as the FGD paper draws them (matplotlib, Agg backend: no display needed).

* ``unallocated_<workload>.png``: unallocated GPU % vs arrived GPU % (of capacity), one line per policy,
  mean over seeds;
* ``unallocated_at_100.png``: unallocated GPU % at 100 % arrived, bars per workload and policy, ± sd;
* ``churn_<workload>.png``: allocated GPU % over simulated time, a line per churn run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from octacloud.sim.experiment import ChurnResult
from octacloud.sim.metrics import ARRIVED_PERCENTS
from octacloud.sim.report import CurveRow, mean_sd


def _unallocated(row: CurveRow, at: int) -> float | None:
    value = row.at(at)
    return None if value is None else 100.0 - value


def _by_workload_policy(rows: Sequence[CurveRow]) -> dict[str, dict[str, list[CurveRow]]]:
    out: dict[str, dict[str, list[CurveRow]]] = {}
    for row in rows:
        out.setdefault(row.workload, {}).setdefault(row.sc_policy, []).append(row)
    return out


def unallocated_curves(rows: Sequence[CurveRow], out_dir: Path) -> list[Path]:
    """One PNG per workload: mean unallocated GPU % over seeds vs arrived %, a line per policy."""
    written: list[Path] = []
    for workload, policies in _by_workload_policy(rows).items():
        fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=120)
        for policy in sorted(policies):
            xs: list[int] = []
            ys: list[float] = []
            for a in ARRIVED_PERCENTS:
                mean, _ = mean_sd(_unallocated(r, a) for r in policies[policy])
                if mean is not None:
                    xs.append(a)
                    ys.append(mean)
            ax.plot(xs, ys, label=policy, linewidth=1.4)
        ax.set_xlabel("arrived GPU request (% of capacity)")
        ax.set_ylabel("unallocated GPUs (%)")
        ax.set_title(workload)
        ax.set_xlim(ARRIVED_PERCENTS[0], ARRIVED_PERCENTS[-1])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"unallocated_{workload}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def unallocated_bars(rows: Sequence[CurveRow], out_dir: Path, *, at: int = 100) -> Path:
    """Unallocated GPU % at ``at`` % arrived: grouped bars (workload × policy) with ± sd error bars."""
    grouped = _by_workload_policy(rows)
    workloads = list(grouped)
    policies = sorted({p for per in grouped.values() for p in per})
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 3.0), 4.2), dpi=120)
    for k, policy in enumerate(policies):
        means: list[float] = []
        sds: list[float] = []
        for workload in workloads:
            mean, sd = mean_sd(_unallocated(r, at) for r in grouped[workload].get(policy, []))
            means.append(mean if mean is not None else 0.0)
            sds.append(sd if sd is not None else 0.0)
        xs = [w + (k - (len(policies) - 1) / 2) * width for w in range(len(workloads))]
        ax.bar(xs, means, width=width, yerr=sds, capsize=2, label=policy)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([w.removeprefix("openb_pod_list_") for w in workloads])
    ax.set_ylabel(f"unallocated GPUs at {at} % arrived (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"unallocated_at_{at}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def churn_timelines(results: Sequence[ChurnResult], out_dir: Path) -> list[Path]:
    """One PNG per workload: allocated GPU % over simulated time, a line per (policy, seed)."""
    by_workload: dict[str, list[ChurnResult]] = {}
    for r in results:
        by_workload.setdefault(r.spec.workload, []).append(r)
    written: list[Path] = []
    for workload, runs in by_workload.items():
        fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=120)
        for r in runs:
            hours = [t / 3600.0 for t, _ in r.timeline]
            ax.plot(hours, [v for _, v in r.timeline], linewidth=1.0, label=f"{r.spec.policy} seed {r.spec.seed}")
        ax.set_xlabel("simulated time (h)")
        ax.set_ylabel("allocated GPUs (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{workload}: churn")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"churn_{workload}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
