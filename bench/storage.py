"""Cold start from the model store vs the node cache vs a local folder, and the bytes one deployment fetches
when it scales from 1 to 8 replicas on one node — side by side in one run, against a real S3 store
(SeaweedFS, ``weed mini`` on loopback, started here).

    OCTACLOUD_MODELS=models scripts/netns-run .venv/bin/python bench/storage.py --model resnet50
    .venv/bin/python bench/storage.py --model mlp --out bench/results/storage.json   # also write the figures

Cold start is measured in the replica's own parts: *fetch* (store → node cache, or the cache's check of what
it holds), *load* (the runtime) and *warm-up* (its first batches), as ``octacloud_replica_cold_start_seconds``
exports them. Scale-out is measured three ways: one deployment on a cloud that reads the store, scaled from 1
to 8 replicas on one node (the bytes its replicas' fetch reports say they copied); 8 replica fetches at once as
processes into one node cache; and — the baseline of a per-replica download, as Triton's cloud repositories
do — the same 8 into 8 caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))

from tests.storage.seaweed import SeaweedS3  # noqa: E402

from octacloud.control.launcher import LaunchSpec, model_view  # noqa: E402
from octacloud.control.models import fetch_model  # noqa: E402
from octacloud.storage.cache import NodeCache  # noqa: E402
from octacloud.storage.publish import publish_folder  # noqa: E402
from octacloud.storage.store import FsspecStore, open_store  # noqa: E402
from record import Recorder, add_flag  # noqa: E402


async def load_parts(model_dir: Path, versions: tuple[int, ...] | None, scratch: Path) -> dict[str, float]:
    """Load ``model_dir`` as a replica does (explicit mode, one model) and return its load and warm-up."""
    from octacloud.serving import ControlMode, ModelRepository

    view = model_view(LaunchSpec("bench", "served", model_dir, "", {}, 2), scratch, versions)
    repo = ModelRepository(view, control_mode=ControlMode.EXPLICIT, threads=2)
    await repo.start(["served"])
    try:
        return dict(repo.get("served").cold_start)
    finally:
        await repo.close()


def cold_starts(store: FsspecStore, local: Path, model: str, work: Path) -> dict[str, dict[str, float]]:
    cache = NodeCache(work / "node-cache")
    rows: dict[str, dict[str, float]] = {}
    for name in ("store", "cache"):  # empty cache first: the fetch is a download; then the same, a hit
        started = time.monotonic()
        got = fetch_model(cache, store, model, "")
        fetch = time.monotonic() - started
        parts = asyncio.run(load_parts(got.path, got.versions, work / f"view-{name}"))
        rows[name] = {"fetch": fetch, **parts, "bytes": float(got.bytes_copied)}
    parts = asyncio.run(load_parts(local / model, None, work / "view-local"))
    rows["local folder"] = {"fetch": 0.0, **parts, "bytes": 0.0}
    return rows


FETCH = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {src!r})
    from octacloud.control.models import fetch_model
    from octacloud.storage.cache import NodeCache
    from octacloud.storage.store import open_store
    got = fetch_model(NodeCache(Path(sys.argv[1])), open_store({url!r}, Path({creds!r})), {model!r}, "")
    print(json.dumps({{"hit": got.hit, "bytes": got.bytes_copied}}))
""")


def scale_out(url: str, creds: Path, model: str, work: Path, replicas: int, shared: bool) -> dict[str, float]:
    """``replicas`` fetches at once, as processes, into one cache (``shared``) or one cache each."""
    script = FETCH.format(src=str(ROOT / "src"), url=url, creds=str(creds), model=model)
    roots = [work / ("one-cache" if shared else f"cache-{i}") for i in range(replicas)]
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE) for r in roots]
    results = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    return {"bytes": float(sum(r["bytes"] for r in results)), "seconds": time.monotonic() - started,
            "downloads": float(sum(not r["hit"] for r in results))}  # fmt: skip


def deployment_scale_out(store_url: str, creds: Path, model: str, work: Path, replicas: int) -> dict[str, float]:
    """One deployment of ``model`` on a cloud reading the store (local replicas, one node of two CPU cards), scaled
    from 1 to ``replicas``: the bytes every replica's fetch copied into the node cache, from their fetch reports."""
    from tests.ray.harness import CloudThread, fast_config, wait_until

    from octacloud.app import Cloud
    from octacloud.control.fleet import CPU_CARD_MODEL
    from octacloud.core import Gpu, Node

    fleet = [Node("node-a", 16_000, 65_536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2)))]
    config = fast_config(work / "state", work / "no-local-repository")
    config.model_storage, config.storage_credentials = store_url, creds
    cloud = CloudThread(lambda: Cloud(config, nodes=fleet))
    started = time.monotonic()
    try:
        spec = {"name": "bench", "model": model, "octants": 1, "max_replicas": replicas, "priority": 100}
        answer = cloud.admin("POST", "/deployments", spec)
        if answer.status_code != 201:
            raise SystemExit(f"deploy answered {answer.status_code}: {answer.text}")
        wait_until("one ready replica", lambda: len(cloud.ready("bench")) == 1, timeout=300)
        cloud.admin("POST", "/deployments/bench/scale", {"replicas": replicas})
        wait_until(f"{replicas} ready replicas", lambda: len(cloud.ready("bench")) == replicas, timeout=600)
        seconds = time.monotonic() - started
        reports = [json.loads(p.read_text()) for p in (config.state_dir / "replicas").glob("*/fetch.json")]
    finally:
        cloud.stop(stop_replicas=True)
    return {"bytes": float(sum(int(r["bytes"]) for r in reports)), "seconds": seconds,
            "downloads": float(sum(not r["hit"] for r in reports)), "replicas": float(len(reports))}  # fmt: skip


class Held:
    """The simulated fleet's node caches: node → models fetched (no limit)."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}

    def holds(self, node: str, model: str) -> bool:
        return model in self.held.get(node, set())


def placement(weight: float, seed: int = 0, nodes: int = 16, bandwidth_gb_s: float = 1.25) -> dict[str, float]:
    """Replicas of 8 models (0.25..12 GB, Zipf-popular, 1..8 octants) arrive and leave on ``nodes`` 8-card
    nodes until the first finds no room, placed by the product profile plus the ``model-cache`` term at
    ``weight`` (0: off). Cold start saved: GB not downloaded (at ``bandwidth_gb_s``); packing lost: the GPU
    allocated when the first replica finds no room."""
    import random

    from octacloud.core import Gpu, Node
    from octacloud.core.model import Request
    from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT
    from octacloud.scheduler.framework import ClusterState, Scheduler, WeightedScorer
    from octacloud.scheduler.plugins.model_cache import ModelCacheAffinity
    from octacloud.scheduler.policies import cloud_profile

    rng = random.Random(seed)
    sizes = {f"m{i}": 0.25 * 2 ** (i * 5.6 / 7) for i in range(8)}  # 0.25 GB .. 12 GB
    popularity = [1 / (i + 1) for i in range(8)]
    fleet = [Node(f"n{k:02d}", 64_000, 262_144, tuple(Gpu(g, "H100", 81_920) for g in range(8))) for k in range(nodes)]
    held = Held()
    profile = cloud_profile()
    if weight > 0:
        profile.scorers.append(WeightedScorer(ModelCacheAffinity(held), weight))
    scheduler = Scheduler(ClusterState(fleet), profile)
    live: list[str] = []
    downloaded = needed = 0.0
    placed = 0
    for step in range(100_000):
        if live and rng.random() < 0.45:
            scheduler.release(live.pop(rng.randrange(len(live))))
        model = rng.choices(list(sizes), popularity)[0]
        octants = rng.choice([1, 1, 2, 2, 4, 8])
        milli = octants * MILLI_PER_OCTANT if octants < 8 else MILLI_PER_GPU
        r = Request(f"r{step}", num_gpu=1, gpu_milli=milli, cpu_milli=1000, memory_mib=4096, model=model)
        decision = scheduler.schedule(r)
        if decision.placement is None:
            break
        placed += 1
        live.append(r.name)
        needed += sizes[model]
        node = decision.placement.node
        if not held.holds(node, model):
            downloaded += sizes[model]
            held.held.setdefault(node, set()).add(model)
    total = nodes * 8 * MILLI_PER_GPU
    used = sum(a.placement.milli_per_gpu * len(a.placement.gpus) for a in scheduler.state.allocations.values())
    whole = sum(free == MILLI_PER_GPU for cards in scheduler.state.free_gpu for free in cards)
    return {"placed": float(placed), "gpu_allocated": used / total, "downloaded_gb": downloaded,
            "whole_free_cards": float(whole),
            "cold_start_s": downloaded / bandwidth_gb_s, "hit_ratio": 1 - downloaded / needed}  # fmt: skip


def report_placement(weights: list[float]) -> dict[str, dict[str, float]]:
    rows = {f"{w:g}": placement(w) for w in weights}
    base = rows[f"{weights[0]:g}"]
    print("cache-aware placement: the model-cache term's weight against the product profile, one simulated run:")
    print(f"  {'weight':>6}{'placed':>8}{'GPU at 1st miss':>17}{'whole cards free':>18}{'GB fetched':>12}"
          f"{'hit ratio':>11}{'download s saved':>18}")  # fmt: skip
    for w, r in rows.items():
        saved = base["cold_start_s"] - r["cold_start_s"]
        print(f"  {w:>6}{int(r['placed']):>8}{r['gpu_allocated']:>17.1%}{int(r['whole_free_cards']):>18}"
              f"{r['downloaded_gb']:>12.1f}{r['hit_ratio']:>11.1%}{saved:>18.1f}")  # fmt: skip
    print("  (packing lost: fewer replicas placed, less GPU allocated, fewer whole cards left free than at weight 0)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--placement-only", action="store_true", help="only the cache-aware placement trade-off")
    add_flag(parser)
    args = parser.parse_args()
    recorder = Recorder("storage")
    weights = [0.0, 0.25, 0.5, 1.0, 2.0, 5.0]
    if args.placement_only:
        recorder.save({"placement": report_placement(weights)})
        return
    source = args.models / args.model
    if not (source / "config.pbtxt").is_file():
        raise SystemExit(f"{source} is not a model folder (build the examples: make models)")
    with tempfile.TemporaryDirectory(prefix="octacloud-bench-storage-") as tmp:
        work = Path(tmp)
        server = SeaweedS3(work / "s3")
        server.start()
        try:
            server.create_bucket("models")
            creds = server.credentials_file(work / "credentials")
            store = open_store("s3://models/bench", creds)
            publish_folder(store, args.models, [args.model])
            size = sum(f.size for f in store.files(args.model, store.versions(args.model)[-1]).values())
            starts = cold_starts(store, args.models, args.model, work)
            shared = scale_out(store.url, creds, args.model, work / "shared", args.replicas, shared=True)
            apart = scale_out(store.url, creds, args.model, work / "apart", args.replicas, shared=False)
            deployed = deployment_scale_out(store.url, creds, args.model, work / "cloud", args.replicas)
        finally:
            server.stop()
    report(args.model, size, starts, {"one deployment, scaled by the cloud": deployed, "one node cache": shared,
                                      "a copy per replica": apart}, args.replicas)  # fmt: skip
    placed = report_placement(weights)
    figures: dict[str, Any] = {"model": args.model, "bytes": size, "cold_start": starts, "placement": placed,
                               "scale_out": {"one deployment, scaled by the cloud": deployed,
                                             "one node cache": shared, "a copy per replica": apart}}  # fmt: skip
    recorder.save(figures)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


def report(model: str, size: int, starts: dict[str, dict[str, float]], outs: dict[str, dict[str, float]],
           replicas: int) -> None:  # fmt: skip
    print(f"cold start of {model} ({size / 2**20:.1f} MiB published), seconds by part, one run:")
    print(f"  {'from':<14}{'fetch':>9}{'load':>9}{'warm-up':>9}{'total':>9}{'MiB fetched':>13}")
    for name, p in starts.items():
        total = p["fetch"] + p.get("load", 0.0) + p.get("warmup", 0.0)
        print(f"  {name:<14}{p['fetch']:>9.3f}{p.get('load', 0):>9.3f}{p.get('warmup', 0):>9.3f}{total:>9.3f}"
              f"{p['bytes'] / 2**20:>13.1f}")  # fmt: skip
    store_total = sum(starts["store"][k] for k in ("fetch", "load", "warmup"))
    cache_total = sum(starts["cache"][k] for k in ("fetch", "load", "warmup"))
    print(f"  from the store / from the node cache: {store_total / cache_total:.2f}x the cold start")
    print(
        f"scale-out 1 -> {replicas} replicas on one node (the cloud: one deployment scaled; the others: "
        f"{replicas} fetches at once):"
    )
    for name, r in outs.items():
        print(f"  {name:<36} {r['bytes'] / 2**20:>8.1f} MiB fetched ({r['bytes'] / size:.2f}x the model), "
              f"{int(r['downloads'])} download(s), {r['seconds']:.2f} s")  # fmt: skip
    apart, shared = outs["a copy per replica"], outs["one node cache"]
    print(f"  bytes saved by the node cache: {apart['bytes'] / max(shared['bytes'], 1):.1f}x")


if __name__ == "__main__":
    main()
