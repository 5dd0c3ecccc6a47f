"""Generation through octacloud's gateway vs the engine's own OpenAI server, side by side in one run.

    .venv/bin/python bench/llm.py [--model-dir DIR] [--streams 1 8 32] [--max-tokens 64] [--rounds 3]
                                  [--via engine replica octacloud inproc]

Starts ``octacloud up`` (a one-node, one-card CPU fleet) and deploys SmolLM2 (``$OCTACLOUD_MODELS/smollm2``, or
``--model-dir``) on the whole card, so that its engine gets every core; then starts llama.cpp's own
``llama-server`` on the same GGUF with the same engine arguments (the version's ``model.json``: slots, context,
batch, KV cache types; the same thread count) on a loopback port. At each number of concurrent streams it runs
the same closed loop against both, interleaved point by point (the order alternates every round, so that a drift
of the machine's load falls on both alike): each stream asks a streamed chat completion (a fixed prompt,
``max_tokens`` tokens at temperature 0, so both servers generate the same tokens), waits for its end, and asks
again, until the point's ``--completions`` (at least two per stream) are done. Both servers are warmed up first.

Printed per point: output tokens per second (completion tokens over the point's wall time), time to first token
p50/p99 (request sent → first generated token), inter-token latency p50/p99 (between two tokens of a stream),
octacloud ÷ engine for each, and the goals: throughput ≥ 0.95×, TTFT p99 ≤ 1.1×, and octacloud's tokens per
second at 8 streams ≥ 2× at 1 stream (continuous batching against one stream at a time). Both servers run while
the bench runs; only one is under load at a time. Each run appends its figures to ``bench/results/llm.jsonl``
(``bench/record.py``; ``--no-record`` does not).

``octacloud`` is ``octacloud up`` as it runs by default: the gateway's fronts in a worker process
(``--gateway-workers 1``), whose event loop does nothing but relay, away from the controller, the health probes
and the meter in ``up``'s own process. ``--via`` names the servers compared (``engine`` and ``octacloud`` by
default, which the goals compare); to see what each hop adds, also ``replica`` (the replica's own port, asked
with the cloud's internal secret, as the gateway asks it) and ``inproc`` (a second cloud whose gateway runs in
``up``'s process, ``--gateway-workers 0``, on the loop the controller also runs on).

The client is octacloud's streaming HTTP/1.1 client in this process (asyncio; it costs both sides the same); the
gateway's key is the admin key ``up`` wrote. The engine's own server gets no key (it is on loopback, as a user
would run it in a benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import LocalCloud, cpu_s, find_replica_pid, free_port, proc_stat
from octacloud.security.internal_auth import HEADER_BYTES, REPLICA_HEADER_BYTES
from octacloud.serving.generate.args import EngineArgs
from octacloud.serving.generate.client import Target, request
from octacloud.serving.generate.engine import find_llama_server
from octacloud.serving.generate.sse import EventSplitter, data_of
from record import Recorder, add_flag

ROOT = Path(__file__).resolve().parent.parent
VIA = ("engine", "replica", "octacloud", "inproc")
PROMPT = [{"role": "user", "content": "Write a long story about a robot who learns to paint."}]


@dataclass(slots=True)
class Point:
    """One closed-loop run against one server."""

    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_s: float = 0.0
    """CPU time the server's processes used during the point (the engine's, and octacloud's around it)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_s / self.tokens if self.tokens else float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(target: Target, headers: list[tuple[bytes, bytes]], body: bytes, point: Point) -> None:
    sent = time.perf_counter()
    answer = await request(target, b"POST", b"/v1/chat/completions", headers, body, head_timeout=600)
    if answer.status != 200:
        point.errors += 1
        await answer.read()
        return
    splitter = EventSplitter()
    last = 0.0
    async for chunk in answer.chunks():
        for event in splitter.feed(chunk):
            data = data_of(event)
            if not isinstance(data, dict):
                continue
            if data.get("usage"):
                point.tokens += int(data["usage"].get("completion_tokens", 0))
            choices = data.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                if last:
                    point.itl_ms.append((now - last) * 1000)
                else:
                    point.ttft_ms.append((now - sent) * 1000)
                last = now


@dataclass(frozen=True, slots=True)
class Server:
    """One server the bench asks: where, and the headers that authorize the call there."""

    name: str
    target: Target
    auth: tuple[tuple[bytes, bytes], ...] = ()
    pid: int = 0
    """The server's first process: its CPU time and its descendants' is the point's ``cpu_s``."""


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(proc_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def tree_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_s(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


async def run_point(server: Server, streams: int, completions: int, max_tokens: int) -> Point:
    """``completions`` streamed completions asked by ``streams`` concurrent closed loops (each its share)."""
    target = server.target
    headers = [(b"content-type", b"application/json"), *server.auth]
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    point = Point()

    left = [completions]
    pids = process_tree(server.pid) if server.pid else []
    cpu_before = tree_cpu_s(pids)

    async def loop() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one_stream(target, headers, body, point)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(streams)))
    point.wall_s = time.perf_counter() - started
    point.cpu_s = tree_cpu_s(pids) - cpu_before
    return point


def start_engine(model_dir: Path, threads: int) -> tuple[subprocess.Popen[bytes], Target, Path]:
    """llama.cpp's own server on the version's engine arguments, on a loopback port; waits until it serves."""
    version = max((p for p in model_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    args = EngineArgs.read(version)
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="octacloud-llm-engine-", suffix=".log")[1])
    argv = [str(find_llama_server()), *args.argv(version.resolve() / args.model, alias="smollm2", threads=threads,
                                                  gpu=False), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    target = Target("127.0.0.1", port)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            answer = asyncio.run(request(target, b"GET", b"/health", [], head_timeout=2))
            if answer.status == 200:
                return proc, target, log
        except Exception:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited; see {log}")
        time.sleep(0.2)
    raise SystemExit(f"llama-server did not come up; see {log}")


def row(name: str, streams: int, p: Point) -> str:
    return (
        f"{name:<10} {streams:>7} {p.tokens_per_s:>9.1f} {pct(p.ttft_ms, 0.5):>9.1f} {pct(p.ttft_ms, 0.99):>9.1f} "
        f"{pct(p.itl_ms, 0.5):>8.1f} {pct(p.itl_ms, 0.99):>8.1f} {p.errors:>6} {p.cpu_ms_per_token:>9.2f}"
    )


def merge(points: list[Point]) -> Point:
    out = Point()
    for p in points:
        out.tokens += p.tokens
        out.wall_s += p.wall_s
        out.ttft_ms += p.ttft_ms
        out.itl_ms += p.itl_ms
        out.errors += p.errors
        out.cpu_s += p.cpu_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    models = Path(os.environ.get("OCTACLOUD_MODELS", ROOT / "models"))
    parser.add_argument("--model-dir", type=Path, default=models / "smollm2")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--completions", type=int, default=16, help="Completions per point (at least 2 per stream: 2 × streams)."
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--via", nargs="+", choices=VIA, default=["engine", "octacloud"], help="Servers compared (module docstring)."
    )
    add_flag(parser)
    opts = parser.parse_args()
    recorder = Recorder("llm")
    if not (opts.model_dir / "config.pbtxt").is_file():
        raise SystemExit(f"{opts.model_dir} is not a model folder: run `make models` (or pass --model-dir)")
    cores = os.cpu_count() or 1
    repo = Path(tempfile.mkdtemp(prefix="octacloud-llm-repo-"))
    (repo / "smollm2").symlink_to(opts.model_dir.resolve(), target_is_directory=True)
    # A card's 6 octants (what one replica may hold with the failover reserve kept) get every core of the machine.
    cpu_milli = -(-cores * 8 // 6) * 1000
    clouds = {"octacloud": LocalCloud(repo, prefix="octacloud-llm-bench-", cpu_milli=cpu_milli,
                                      extra=["--gateway-workers", "1"])}  # fmt: skip
    if "inproc" in opts.via:
        clouds["inproc"] = LocalCloud(repo, prefix="octacloud-llm-bench-", cpu_milli=cpu_milli)
    engine, log = None, None
    try:
        servers, threads = {}, 0
        for name, cloud in clouds.items():
            cloud.start()
            replica = cloud.deploy({"name": "smollm2", "model": "smollm2", "octants": 6})
            threads = int(replica["env"]["OCTACLOUD_THREADS"])
            servers[name] = Server(name, Target("127.0.0.1", cloud.http_port),
                                   ((b"authorization", f"Bearer {cloud.key}".encode()),), cloud.pid)  # fmt: skip
            if name == "octacloud":
                internal = ((HEADER_BYTES, cloud.secret.encode()), (REPLICA_HEADER_BYTES, replica["id"].encode()))
                address = Target("127.0.0.1", int(replica["http_port"]))
                servers["replica"] = Server("replica", address, internal, find_replica_pid(address.port))
        engine, direct, log = start_engine(opts.model_dir, threads)
        servers["engine"] = Server("engine", direct, pid=engine.pid)
        chosen = [servers[name] for name in VIA if name in opts.via]
        for server in chosen:  # warm each up: first prompt, caches, connections
            asyncio.run(run_point(server, 2, 4, 16))
        results: dict[tuple[str, int], list[Point]] = {}
        for streams in opts.streams:
            completions = max(opts.completions, 2 * streams)
            for r in range(opts.rounds):
                for server in chosen if r % 2 == 0 else chosen[::-1]:
                    point = asyncio.run(run_point(server, streams, completions, opts.max_tokens))
                    results.setdefault((server.name, streams), []).append(point)
                    print(f"  {row(server.name, streams, point)}  (round {r + 1}, load {os.getloadavg()[0]:.1f})",
                          flush=True)  # fmt: skip
        recorder.save(report(results, opts, threads))
    finally:
        if engine is not None:
            engine.send_signal(signal.SIGTERM)
            engine.wait(30)
        if log is not None:
            log.unlink(missing_ok=True)
        for cloud in clouds.values():
            cloud.stop()


def report(results: dict[tuple[str, int], list[Point]], opts: argparse.Namespace, threads: int) -> dict[str, Any]:
    """Print the table and the goals; returns the figures to record."""
    print(f"\n{'server':<10} {'streams':>7} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'errors':>6} {'CPU/token':>9}")  # fmt: skip
    print(f"  (ms; {threads} threads, {opts.max_tokens} tokens a completion; CPU/token: the server's processes)")
    record: dict[str, Any] = {"threads": threads, "max_tokens": opts.max_tokens, "via": opts.via, "points": []}
    merged = {key: merge(points) for key, points in results.items()}
    names = [name for name in VIA if name in opts.via]
    for streams in opts.streams:
        point: dict[str, Any] = {"streams": streams}
        for name in names:
            print(row(name, streams, merged[(name, streams)]))
            point[name] = _figures(merged[(name, streams)])
        theirs = merged.get(("engine", streams))
        for name in [n for n in names if n != "engine" and theirs is not None]:
            assert theirs is not None
            ours = merged[(name, streams)]
            ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else float("nan")
            ttft = pct(ours.ttft_ms, 0.99) / pct(theirs.ttft_ms, 0.99)
            print(f"{'ratio':<10} {streams:>7} {ratio:>9.3f} {'':>9} {ttft:>9.3f}   ({name} ÷ engine)")
            if name == "octacloud":
                point["throughput_ratio"], point["ttft_p99_ratio"] = ratio, ttft
        record["points"].append(point)
    goals = []
    for p in record["points"]:
        if "throughput_ratio" not in p:
            continue
        goals.append((f"throughput at {p['streams']} stream(s) ≥ 0.95× the engine's", p["throughput_ratio"] >= 0.95))
        goals.append((f"TTFT p99 at {p['streams']} stream(s) ≤ 1.1× the engine's", p["ttft_p99_ratio"] <= 1.1))
    if 1 in opts.streams and 8 in opts.streams and {"engine", "octacloud"} <= set(names):
        batching = merged[("octacloud", 8)].tokens_per_s / merged[("octacloud", 1)].tokens_per_s
        own = merged[("engine", 8)].tokens_per_s / merged[("engine", 1)].tokens_per_s
        record["batching_8_vs_1"] = {"octacloud": batching, "engine": own}
        goals.append((f"8 streams ≥ 2× one at a time (octacloud {batching:.2f}×; the engine alone {own:.2f}×)",
                      batching >= 2))  # fmt: skip
    print()
    for what, met in goals:
        print(f"  {'met   ' if met else 'MISSED'} {what}")
    record["goals"] = dict(goals)
    sys.stdout.flush()
    return record


def _figures(p: Point) -> dict[str, float]:
    return {
        "tokens_per_s": round(p.tokens_per_s, 2),
        "ttft_p50_ms": round(pct(p.ttft_ms, 0.5), 2),
        "ttft_p99_ms": round(pct(p.ttft_ms, 0.99), 2),
        "itl_p50_ms": round(pct(p.itl_ms, 0.5), 2),
        "itl_p99_ms": round(pct(p.itl_ms, 0.99), 2),
        "errors": p.errors,
        "tokens": p.tokens,
        "cpu_ms_per_token": round(p.cpu_ms_per_token, 3),
    }


if __name__ == "__main__":
    main()
