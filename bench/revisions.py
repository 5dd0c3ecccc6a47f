"""Two revisions of octacloud side by side: bench/serving.py, bench/cloud.py and bench/scheduler_loop.py, in one run.

    scripts/netns-run nice .venv/bin/python bench/revisions.py [--before f697505] [--after HEAD] [--rounds 2]
                                                             [--benches serving cloud scheduler_loop]

Each revision is checked out in a temporary worktree of its own (``git worktree add --detach`` under the system's
temporary folder, removed at the end) and each benchmark runs there as that revision wrote it, its ``src/`` first
on ``PYTHONPATH``, so that code that moved between the revisions is measured where it is. The runs alternate
A B, B A, A B ... round by round (``--rounds``), so that the machine's load drifts over both alike.

A run's figures are read from the benchmark's own summary table on its standard output, the one part of the
output that the compared revisions print alike (a revision older than ``bench/record.py`` writes no record):

* serving: per protocol × concurrency × server, infer/s, p99 and the server's CPU per inference (medians of
  the bench's own rounds);
* cloud: per layout × protocol × concurrency, the direct and the gateway's infer/s, the gateway's p99,
  gateway/direct and the gateway's CPU per inference;
* scheduler_loop: per fleet size (copies of the openb fleet), the indexed pass's CPU and wall time, the pods it
  placed and the moves it made (these two must be equal), and the exhaustive pass's CPU time where it ran.

The table gives, per figure, the median of the rounds before and after with their range (min–max), after/before,
and the noise: the widest range of either side as a share of its median. A ratio further from 1 than the noise
is flagged, ``WORSE`` or ``better`` by which way is good for that figure (a count that differs: ``DIFFERS``);
with a single round there is no noise to compare with and nothing is flagged. The run is appended to
``bench/results/revisions.jsonl`` with every round's figures, both commits, the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# short windows: the three benches twice on both revisions in about 10-15 minutes on a 2-core machine
DEFAULT_ARGS = {
    "serving": "--skip-triton --rounds 1 --window-ms 1500",
    "cloud": "--seconds 2 --layout split",
    "scheduler_loop": "--copies 1,8 --exhaustive-up-to 1",
}
RUN_TIMEOUT_S = 1800  # a deadline against a hung run, far beyond any run's length

# figure name -> which way is good: "up" (throughput), "down" (latency, CPU), "same" (a count that must not move)
Figures = dict[tuple[str, str], float]


@dataclass(frozen=True)
class Row:
    bench: str
    point: str
    figure: str
    before: float
    before_range: tuple[float, float]
    after: float
    after_range: tuple[float, float]
    ratio: float
    noise: float | None
    flag: str


NUM = r"(-?[\d.]+|nan|inf)"
SERVING_ROW = re.compile(rf"^(http|grpc)\s+(\d+) \| (\S+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+\S+\s+\S+ \|")
CLOUD_ROW = re.compile(rf"^(shared|split|apart)\s+(http|grpc)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+"
                       rf"{NUM}\s+{NUM}\s+{NUM}\s+\S+\s*$")  # fmt: skip
SIDE_DIR = re.compile(r"^octa-(before|after)-\w+$")
FLEET_ROW = re.compile(r"^openb fleet ×(\d+): (\d+) nodes, (\d+) GPUs")
PASS_ROW = re.compile(
    r"^\s+(indexed|exhaustive)\s+pass\s+(\d+) ms wall\s+(\d+) ms cpu;.*?(?:; placed (\d+), moves (\d+))?$"
)

DIRECTION = {
    "infer/s": "up",
    "p99 ms": "down",
    "cpu us/inf": "down",
    "direct infer/s": "up",
    "gateway infer/s": "up",
    "gateway p99 ms": "down",
    "gateway/direct": "up",
    "gateway cpu us/inf": "down",
    "indexed cpu ms": "down",
    "indexed wall ms": "down",
    "exhaustive cpu ms": "down",
    "placed": "same",
    "moves": "same",
}


def parse_serving(out: str) -> Figures:
    """The medians table of bench/serving.py: (point, figure) -> value."""
    figures: Figures = {}
    for line in out.splitlines():
        m = SERVING_ROW.match(line)
        if m:
            point = f"{m[1]} c={m[2]} {m[3]}"
            figures[(point, "infer/s")] = float(m[4])
            figures[(point, "p99 ms")] = float(m[6])
            figures[(point, "cpu us/inf")] = float(m[7])
    return figures


def parse_cloud(out: str) -> Figures:
    """The summary table of bench/cloud.py: (point, figure) -> value."""
    figures: Figures = {}
    for line in out.splitlines():
        m = CLOUD_ROW.match(line)
        if m:
            point = f"{m[1]} {m[2]} c={m[3]}"
            figures[(point, "direct infer/s")] = float(m[4])
            figures[(point, "gateway infer/s")] = float(m[7])
            figures[(point, "gateway p99 ms")] = float(m[9])
            figures[(point, "gateway/direct")] = float(m[10])
            figures[(point, "gateway cpu us/inf")] = float(m[11])
    return figures


def parse_scheduler_loop(out: str) -> Figures:
    """The per-fleet pass lines of bench/scheduler_loop.py: (point, figure) -> value."""
    figures: Figures = {}
    point = ""
    for line in out.splitlines():
        fleet = FLEET_ROW.match(line)
        if fleet:
            point = f"×{fleet[1]} ({fleet[3]} GPUs)"
            continue
        m = PASS_ROW.match(line)
        if m and point:
            figures[(point, f"{m[1]} cpu ms")] = float(m[3])
            if m[1] == "indexed":
                figures[(point, "indexed wall ms")] = float(m[2])
                if m[4] is not None:
                    figures[(point, "placed")] = float(m[4])
                    figures[(point, "moves")] = float(m[5])
    return figures


PARSERS: dict[str, Callable[[str], Figures]] = {
    "serving": parse_serving,
    "cloud": parse_cloud,
    "scheduler_loop": parse_scheduler_loop,
}


def order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order the runs go: A B, B A, A B, ..."""
    return [(r, side) for r in range(rounds) for side in (("before", "after") if r % 2 == 0 else ("after", "before"))]


def compare(bench: str, point: str, figure: str, before: Sequence[float], after: Sequence[float]) -> Row:
    """One figure's row: medians, ranges, after/before, the rounds' noise and the flag."""
    b, a = statistics.median(before), statistics.median(after)
    ratio = a / b if b else (1.0 if a == b else float("inf"))
    noise = None
    if len(before) > 1 and len(after) > 1:
        noise = max((max(xs) - min(xs)) / abs(m) if m else 0.0 for xs, m in ((before, b), (after, a)))
    direction = DIRECTION.get(figure, "down")
    flag = ""
    if direction == "same":
        flag = "" if set(before) == set(after) and len(set(before)) == 1 else "DIFFERS"
    elif noise is not None and abs(ratio - 1) > noise:
        flag = "better" if (ratio > 1) == (direction == "up") else "WORSE"
    return Row(bench, point, figure, b, (min(before), max(before)), a, (min(after), max(after)), ratio, noise, flag)


def rows_of(samples: dict[str, dict[str, list[Figures]]]) -> list[Row]:
    """samples[bench][side] is one Figures per round; a figure missing from a round is left out of that round."""
    rows = []
    for bench, sides in samples.items():
        keys = list(dict.fromkeys(k for figs in sides["before"] + sides["after"] for k in figs))
        for point, figure in keys:
            before = [f[(point, figure)] for f in sides["before"] if (point, figure) in f]
            after = [f[(point, figure)] for f in sides["after"] if (point, figure) in f]
            if before and after:
                rows.append(compare(bench, point, figure, before, after))
    return rows


def num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(rows: Sequence[Row]) -> str:
    head = (f"{'bench':14} {'point':22} {'figure':18} {'before':>8} {'(min-max)':>15} {'after':>8} "
            f"{'(min-max)':>15} {'after/before':>12} {'noise':>6}  flag")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        noise = "-" if r.noise is None else f"{100 * r.noise:.0f}%"
        lines.append(
            f"{r.bench:14} {r.point:22} {r.figure:18} {num(r.before):>8} "
            f"{num(r.before_range[0]) + '-' + num(r.before_range[1]):>15} {num(r.after):>8} "
            f"{num(r.after_range[0]) + '-' + num(r.after_range[1]):>15} {r.ratio:>12.3f} {noise:>6}  {r.flag}"
        )
    return "\n".join(lines)


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


OWNER = "owner.pid"  # in a temporary worktree's folder: the run that made it


def ours(porcelain: str, tmp: Path) -> list[Path]:
    """The worktrees ``git worktree list --porcelain`` names that a run of this bench made under ``tmp``."""
    paths = [Path(line.split(" ", 1)[1]) for line in porcelain.splitlines() if line.startswith("worktree ")]
    return [p for p in paths if p.name == "octacloud" and p.parent.parent == tmp and SIDE_DIR.match(p.parent.name)]


def stale(trees: Sequence[Path], alive: Callable[[int], bool]) -> list[Path]:
    """Those of ``trees`` whose run is gone (killed before it could remove them); one with no owner is left."""
    found = []
    for tree in trees:
        try:
            pid = int((tree.parent / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not alive(pid):
            found.append(tree)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(tree: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", "--force", str(tree)],
        capture_output=True,
        check=False,
    )
    shutil.rmtree(tree.parent, ignore_errors=True)


def remove_stale() -> list[Path]:
    """Remove the temporary worktrees of earlier runs that were killed (kill -9) before they removed them."""
    found = stale(ours(git("worktree", "list", "--porcelain"), Path(tempfile.gettempdir())), alive)
    for tree in found:
        remove(tree)
    return found


@contextmanager
def worktree(revision: str, side: str) -> Iterator[Path]:
    """A detached checkout of ``revision`` in a temporary folder, removed (and unregistered) afterwards."""
    parent = Path(tempfile.mkdtemp(prefix=f"octa-{side}-"))
    (parent / OWNER).write_text(str(os.getpid()))
    tree = parent / "octacloud"
    try:
        git("worktree", "add", "--detach", "--quiet", str(tree), revision)
        yield tree
    finally:
        remove(tree)


def run_bench(tree: Path, bench: str, args: list[str]) -> str:
    """One run of ``bench`` as the checkout at ``tree`` has it, with its own src/; its standard output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree)])}
    argv = [sys.executable, str(tree / "bench" / f"{bench}.py"), *args]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"{bench} at {tree} exited {done.returncode}:\n{tail}")
    return done.stdout


def measure(
    commits: dict[str, str], benches: Sequence[str], bench_args: dict[str, list[str]], rounds: int
) -> dict[str, dict[str, list[Figures]]]:
    """Every bench on both revisions, round by round in :func:`order`: samples[bench][side], one per round."""
    samples: dict[str, dict[str, list[Figures]]] = {b: {"before": [], "after": []} for b in benches}
    with worktree(commits["before"], "before") as before_tree, worktree(commits["after"], "after") as after_tree:
        trees = {"before": before_tree, "after": after_tree}
        for r, side in order(rounds):
            for bench in benches:
                out = run_bench(trees[side], bench, bench_args[bench])
                figures = PARSERS[bench](out)
                if not figures:
                    raise SystemExit(f"{bench} at {side} printed no table to compare:\n{out[-2000:]}")
                samples[bench][side].append(figures)
                load = os.getloadavg()[0]
                print(f"round {r + 1} {side:6} {bench}: {len(figures)} figures; load {load:.1f}", flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import Recorder, add_flag

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="f697505", help="the revision measured as before (default: f697505)")
    parser.add_argument("--after", default="HEAD", help="the revision measured as after (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every bench on both revisions")
    parser.add_argument("--benches", nargs="+", default=list(PARSERS), choices=list(PARSERS))
    for bench, default in DEFAULT_ARGS.items():
        parser.add_argument(f"--{bench.replace('_', '-')}-args", default=default, help=f"{bench}'s options")
    add_flag(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    commits = {side: git("rev-parse", "--verify", f"{getattr(args, side)}^{{commit}}") for side in ("before", "after")}
    recorder = Recorder("revisions", None if argv is None else [sys.argv[0], *argv])
    for tree in remove_stale():
        print(f"removed {tree}, left by a run that was killed", flush=True)
    print(f"before {args.before} = {commits['before'][:12]}; after {args.after} = {commits['after'][:12]}", flush=True)
    samples = measure(commits, args.benches, {b: shlex.split(getattr(args, f"{b}_args")) for b in args.benches},
                      args.rounds)  # fmt: skip
    rows = rows_of(samples)
    print()
    print(table(rows))
    flagged = [r for r in rows if r.flag in ("WORSE", "DIFFERS")]
    print(f"\n{len(flagged)} of {len(rows)} figures flagged WORSE or DIFFERS; noise = the widest min-max range of "
          f"either side's {args.rounds} round(s) as a share of its median")  # fmt: skip
    recorder.save({
        "before": {"revision": args.before, "commit": commits["before"]},
        "after": {"revision": args.after, "commit": commits["after"]},
        "rounds": args.rounds,
        "bench_args": {b: getattr(args, f"{b}_args") for b in args.benches},
        "rows": [asdict(r) for r in rows],
        "samples": {b: {s: [[[p, f, v] for (p, f), v in figs.items()] for figs in runs] for s, runs in sides.items()}
                    for b, sides in samples.items()},
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
