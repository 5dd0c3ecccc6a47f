"""Where benchmark runs are kept: every run of a bench appends one record to ``bench/results/<bench>.jsonl``.

A record is one JSON object on one line: the bench, when it ran (UTC), the command line, the commit, the
machine (CPU model, cores, a speed probe: seconds for a 10-million-step Python loop), the 1-minute load
average at its start and end, and the figures the bench printed. The docs show one current table and link to
these files for the history; ``--no-record`` (every bench that records has it) runs without appending.

    from record import Recorder
    recorder = Recorder("serving")          # at the start: the load and the machine before the run
    ...
    recorder.save(figures)                  # at the end (figures: anything json.dumps takes)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loop_seconds(steps: int = 10_000_000) -> float:
    """Seconds this interpreter takes for ``steps`` empty loop steps: how fast this machine runs Python now."""
    started = time.perf_counter()
    for _ in range(steps):
        pass
    return round(time.perf_counter() - started, 3)


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=RESULTS.parent, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


class Recorder:
    """One run of ``bench``: :meth:`save` appends its record (unless ``--no-record`` is on the command line)."""

    def __init__(self, bench: str, argv: list[str] | None = None) -> None:
        self.bench = bench
        self.argv = list(sys.argv if argv is None else argv)
        self.enabled = "--no-record" not in self.argv
        self.started = datetime.datetime.now(datetime.UTC)
        self.load_start = os.getloadavg()[0]
        self.machine = {"cpu": cpu_model(), "cores": os.cpu_count() or 0, "python_loop_s": loop_seconds(),
                        "system": f"{platform.system()} {platform.release()}"}  # fmt: skip

    def record(self, figures: Any) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "started_utc": self.started.isoformat(timespec="seconds"),
            "ended_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(self.argv),
            "commit": commit(),
            "machine": self.machine,
            "load": [round(self.load_start, 2), round(os.getloadavg()[0], 2)],
            "figures": figures,
        }

    def save(self, figures: Any, results: Path = RESULTS) -> Path | None:
        """Append the run's record to ``results/<bench>.jsonl``; returns the file (None with ``--no-record``)."""
        if not self.enabled:
            return None
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"{self.bench}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(self.record(figures), sort_keys=True, default=str) + "\n")
        print(f"recorded in {path}")
        return path


def add_flag(parser: Any) -> None:
    """``--no-record`` on a bench's argparse parser."""
    parser.add_argument("--no-record", action="store_true", help="do not append this run to bench/results/")
