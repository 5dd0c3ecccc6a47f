"""The scheduler extender's cost: filter + prioritize as kube-scheduler calls them, next to octacloud's own decision.

    scripts/netns-run .venv/bin/python bench/k8s_extender.py [--nodes 1000] [--pods 300] [--fill 0.5]

A fleet of ``--nodes`` nodes (three kinds: 8×A100, 8×H100, 4×T4) is filled to ``--fill`` of its cards with
random slices. Then, for each of ``--pods`` random pods (1..8 octants or 1..2 whole cards), side by side on the
same state:

* **octacloud**: ``Scheduler.decide`` — the decision ``octacloud up`` makes, no I/O;
* **extender**: ``POST /filter`` then ``POST /prioritize`` with the JSON kube-scheduler sends
  (``ExtenderArgs`` with ``NodeNames`` of every node: nodeCacheCapable), encoded, sent, decoded and answered.
  ``--transport asgi`` calls the HTTP app in process (httpx's ASGI transport: JSON and routing, no socket);
  ``http`` goes through uvicorn on 127.0.0.1 (server and client share this process's event loop).

The pod's placement is released after each pod, so every pod sees the same fill. The order of the two
measurements alternates from pod to pod. Printed: p50 and p99 of each, and the extender/octacloud ratios (the
overhead of the wire format and the HTTP round trip). ``--node-list`` also measures a few pods with
``Nodes`` as a full ``v1.NodeList`` (an extender that is not node-cache capable).

``bench/k8s_scheduler.py`` measures the same extender behind the real kube-scheduler, with and without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import uvicorn

from octacloud.core.model import Gpu, Node, Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT
from octacloud.k8s.extender import Extender
from octacloud.k8s.extender_http import build_extender_app
from octacloud.k8s.resources import GPUS, OCTANTS, node_cards, pod_request
from octacloud.scheduler.policies import cloud_profile

KINDS = (("A100", 8, 81_920), ("H100", 8, 81_920), ("T4", 4, 16_384))


def fleet(n: int) -> list[Node]:
    out = []
    for i in range(n):
        model, cards, mib = KINDS[i % len(KINDS)]
        gpus = tuple(Gpu(g, model, mib, g // 4 if cards == 8 else None) for g in range(cards))
        out.append(Node(f"node-{i:04d}", 96_000, 1_048_576, gpus))
    return out


def pod(rng: random.Random) -> dict[str, Any]:
    limits: dict[str, str] = {"cpu": "1", "memory": "2Gi"}
    if rng.random() < 0.85:
        limits[OCTANTS] = str(rng.choice([1, 1, 2, 2, 3, 4, 4, 5, 6, 8]))
    else:
        limits[GPUS] = str(rng.choice([1, 2]))
    uid = str(uuid.UUID(int=rng.getrandbits(128)))
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": f"pod-{uid[:8]}", "namespace": "bench", "uid": uid, "annotations": {}, "labels": {}},
        "spec": {"containers": [{"name": "m", "image": "i", "resources": {"limits": limits, "requests": limits}}]},
        "status": {"phase": "Pending"},
    }


def node_obj(node: Node) -> dict[str, Any]:
    cards = node_cards(node)
    capacity = {"cpu": str(node.cpu_milli // 1000), "memory": f"{node.memory_mib}Mi", OCTANTS: str(node.gpu_count * 8)}
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": node.name, "labels": cards.labels(), "annotations": cards.annotations()},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def fill(ext: Extender, share: float, rng: random.Random) -> None:
    target = share * ext.state.total_gpu_milli
    misses = 0
    while ext.state.allocated_gpu_milli < target and misses < 50:
        request = pod_request(pod(rng))
        assert request is not None
        if ext.scheduler.schedule(request).placement is None:
            misses += 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


Post = Callable[[str, bytes], Awaitable[bytes]]


async def measure(
    ext: Extender, post: Post, pods: int, names: list[str] | None, nodes: list[dict[str, Any]] | None, seed: int
) -> dict[str, list[float]]:
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"octacloud": [], "filter": [], "prioritize": [], "extender": [], "bytes": []}
    index = list(range(len(ext.state)))
    for k in range(pods):
        p = pod(rng)
        request = pod_request(p)
        assert request is not None
        args = (
            {"Pod": p, "NodeNames": names, "Nodes": None}
            if nodes is None
            else {
                "Pod": p,
                "Nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": nodes},
                "NodeNames": None,
            }
        )

        def ours(request: Request = request) -> None:
            t0 = time.perf_counter()
            ext.scheduler.decide(request, index)
            times["octacloud"].append(time.perf_counter() - t0)

        async def theirs(p: dict[str, Any] = p, args: dict[str, Any] = args) -> None:
            t0 = time.perf_counter()
            body = json.dumps(args).encode()
            filtered = json.loads(await post("/filter", body))
            t1 = time.perf_counter()
            kept = filtered.get("NodeNames") or [
                i["metadata"]["name"] for i in (filtered.get("Nodes") or {}).get("items", [])
            ]
            second = (
                {"Pod": p, "NodeNames": kept, "Nodes": None}
                if nodes is None
                else {"Pod": p, "Nodes": filtered["Nodes"], "NodeNames": None}
            )
            scores = json.loads(await post("/prioritize", json.dumps(second).encode()))
            t2 = time.perf_counter()
            assert filtered["Error"] == "" and isinstance(scores, list), filtered
            times["filter"].append(t1 - t0)
            times["prioritize"].append(t2 - t1)
            times["extender"].append(t2 - t0)
            times["bytes"].append(float(len(body)))

        if k % 2:
            ours()
            await theirs()
        else:
            await theirs()
            ours()
        ext.forget(request.name)
    return times


def report(title: str, t: dict[str, list[float]]) -> None:
    ms = 1000.0
    print(f"\n{title}: {len(t['octacloud'])} pods, request body {statistics.mean(t['bytes']) / 1024:.0f} KiB")
    print(f"{'':28}{'p50 ms':>10}{'p99 ms':>10}")
    for key, label in (
        ("octacloud", "octacloud decision"),
        ("filter", "extender filter"),
        ("prioritize", "extender prioritize"),
        ("extender", "extender filter+prioritize"),
    ):
        print(f"{label:28}{pct(t[key], 0.5) * ms:10.3f}{pct(t[key], 0.99) * ms:10.3f}")
    r50 = pct(t["extender"], 0.5) / pct(t["octacloud"], 0.5)
    r99 = pct(t["extender"], 0.99) / pct(t["octacloud"], 0.99)
    print(f"{'ratio extender/octacloud':28}{r50:10.2f}{r99:10.2f}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=300)
    ap.add_argument("--fill", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--transport", choices=["asgi", "http", "both"], default="both")
    ap.add_argument("--node-list", type=int, default=20, help="Pods measured with a full NodeList (0: skip).")
    a = ap.parse_args()
    nodes = fleet(a.nodes)
    ext = Extender(nodes, cloud_profile())
    fill(ext, a.fill, random.Random(a.seed + 10_000))  # other UIDs than the measured pods'
    names = [n.name for n in nodes]
    print(
        f"fleet: {a.nodes} nodes, {ext.state.total_gpu_milli // MILLI_PER_GPU} cards, "
        f"{100 * ext.state.utilisation():.1f} % allocated ({ext.state.allocated_gpu_milli // MILLI_PER_OCTANT} "
        f"octants); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    app = build_extender_app(ext)
    transports = ["asgi", "http"] if a.transport == "both" else [a.transport]
    for transport in transports:
        if transport == "asgi":
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender")
            server = None
        else:
            config = uvicorn.Config(
                app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", http="httptools"
            )
            server = uvicorn.Server(config)
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")

        async def post(path: str, body: bytes, client: httpx.AsyncClient = client) -> bytes:
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            return r.content

        await measure(ext, post, 10, names, None, a.seed + 100)  # warm up
        report(f"nodeCacheCapable (NodeNames), {transport}", await measure(ext, post, a.pods, names, None, a.seed))
        if a.node_list:
            objs = [node_obj(n) for n in nodes]
            report(f"NodeList, {transport}", await measure(ext, post, a.node_list, None, objs, a.seed + 1))
        await client.aclose()
        if server is not None:
            server.should_exit = True
            await task
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
