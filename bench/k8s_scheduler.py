"""The real kube-scheduler with and without octacloud's extender, side by side in one run.

A control plane from ``scripts/k8s-control-plane`` (binaries from ``OCTACLOUD_K8S_BIN``), ``--nodes`` nodes
registered through the API with octacloud's resources and labels, ``octacloud k8s extender`` as its own process,
and two kube-schedulers: ``octacloud`` with ``deploy/k8s/config/scheduler-config.yaml`` (nodeCacheCapable) and
``plain`` without the extender. The same ``--pods`` pods (2 octants each) go to each in turn; printed per
scheduler: pods bound per second (first create to last bind, as the API shows them) and the scheduler's own
latency per pod from its metrics (``scheduler_scheduling_attempt_duration_seconds`` and
``scheduler_pod_scheduling_sli_duration_seconds``: mean of the run), then the ratios. Run it in the loopback
namespace:

    scripts/netns-run .venv/bin/python bench/k8s_scheduler.py --nodes 1000 --pods 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from octacloud.core.model import Gpu, Node
from octacloud.k8s.api import KubeClient, node_path, pods_path
from octacloud.k8s.deviceplugin import publish_node
from octacloud.k8s.resources import GPUS, OCTANTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Recorder, add_flag

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "k8s-control-plane"
NS = "bench"


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleet(n: int) -> list[Node]:
    return [
        Node(f"n{k:04d}", 32_000, 131_072, tuple(Gpu(i, "A100", 81_920, i // 4) for i in range(8))) for k in range(n)
    ]


def script(*args: str, **env: str) -> str:
    done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env={**os.environ, **env}, check=False)
    if done.returncode:
        sys.exit(f"scripts/k8s-control-plane {args[0]} failed:\n{done.stderr}")
    return done.stdout.strip()


async def register(api: KubeClient, nodes: list[Node]) -> None:
    gate = asyncio.Semaphore(16)

    async def one(node: Node) -> None:
        async with gate:
            labels = {"kubernetes.io/hostname": node.name}
            await api.create(
                node_path(), {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": labels}}
            )
            res = {"cpu": "32", "memory": "128Gi", "pods": "110", OCTANTS: "64", GPUS: "8"}
            ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "bench"}
            await api.patch(
                f"{node_path(node.name)}/status",
                {"status": {"capacity": res, "allocatable": res, "conditions": [ready]}},
            )
            await publish_node(api, node, [g.health for g in node.gpus])

    await asyncio.gather(*(one(n) for n in nodes))
    while True:  # until the controller-manager has lifted the not-ready taint from every node
        tainted = [n for n in await api.list(node_path()) if (n.get("spec") or {}).get("taints")]
        if not tainted:
            return
        await asyncio.sleep(1)


def pod(name: str, scheduler: str) -> dict[str, Any]:
    limits = {"cpu": "10m", "memory": "16Mi", OCTANTS: "2"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"bench": scheduler}},
            "spec": {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "m", "image": "x", "resources": {"limits": limits}}]}}  # fmt: skip


def metric(text: str, name: str, labels: str = "") -> tuple[float, float]:
    """(sum, count) of a histogram in Prometheus text, over the series whose labels contain ``labels``."""
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}_(sum|count)(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(2) or ""):
            if m.group(1) == "sum":
                total += float(m.group(3))
            else:
                count += float(m.group(3))
    return total, count


async def run_one(
    api: KubeClient, scheduler: str, metrics_url: str, token: str, ctx: ssl.SSLContext, n: int
) -> dict[str, float]:
    async with httpx.AsyncClient(verify=ctx, headers={"Authorization": f"Bearer {token}"}) as http:
        before = (await http.get(metrics_url)).text
        gate = asyncio.Semaphore(16)

        async def create(k: int) -> None:
            async with gate:
                await api.create(pods_path(NS), pod(f"{scheduler}-{k:04d}", scheduler))

        start = time.perf_counter()
        await asyncio.gather(*(create(k) for k in range(n)))
        while True:
            pods = await api.list(pods_path(NS), label_selector=f"bench={scheduler}")
            if sum(1 for p in pods if p["spec"].get("nodeName")) >= n:
                break
            await asyncio.sleep(0.1)
        elapsed = time.perf_counter() - start
        after = (await http.get(metrics_url)).text
    out = {"pods_per_s": n / elapsed, "elapsed_s": elapsed}
    for key, name, labels in (("attempt_ms", "scheduler_scheduling_attempt_duration_seconds", 'result="scheduled"'),
                              ("sli_ms", "scheduler_pod_scheduling_sli_duration_seconds", "")):  # fmt: skip
        s0, c0 = metric(before, name, labels)
        s1, c1 = metric(after, name, labels)
        out[key] = 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else float("nan")
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=300)
    add_flag(ap)
    a = ap.parse_args()
    recorder = Recorder("k8s_scheduler")
    state = Path(tempfile.mkdtemp(prefix="octacloud-k8s-bench-"))
    ports = {k: port() for k in ("etcd", "peer", "api", "kcm", "ext", "s1", "s2")}
    env = {"K8S_ETCD_PORT": ports["etcd"], "K8S_ETCD_PEER_PORT": ports["peer"], "K8S_API_PORT": ports["api"],
           "K8S_KCM_PORT": ports["kcm"], "K8S_OWNER_PID": os.getpid()}  # fmt: skip
    kubeconfig = script("start", str(state), **{k: str(v) for k, v in env.items()})
    extender = None
    try:
        token, ca = (state / "admin.token").read_text().strip(), state / "pki" / "ca.crt"
        url = f"https://127.0.0.1:{ports['api']}"
        api = KubeClient(url, token=token, verify=str(ca), timeout_s=60)
        t0 = time.perf_counter()
        await register(api, fleet(a.nodes))
        print(f"{a.nodes} nodes registered through the API in {time.perf_counter() - t0:.1f} s")
        await api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        while not await api.list(f"/api/v1/namespaces/{NS}/serviceaccounts"):
            await asyncio.sleep(0.2)
        flags = ["--api-server", url, "--token-file", str(state / "admin.token"), "--ca-file", str(ca)]
        log = (state / "logs" / "extender.log").open("ab")
        cmd = [sys.executable, "-m", "octacloud", "k8s", "extender", "--port", str(ports["ext"]), *flags]
        extender = subprocess.Popen(cmd, stdout=log, stderr=log)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{ports['ext']}/healthz", timeout=1).json()["nodes"] >= a.nodes:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            await asyncio.sleep(0.2)
        shipped = yaml.safe_load((ROOT / "deploy" / "k8s" / "config" / "scheduler-config.yaml").read_text())
        for name, key, with_extender in (("octacloud", "s1", True), ("plain", "s2", False)):
            config = {**shipped, "clientConnection": {"kubeconfig": kubeconfig},
                      "leaderElection": {"leaderElect": False}, "profiles": [{"schedulerName": name}]}  # fmt: skip
            if with_extender:
                config["extenders"] = [
                    {**e, "urlPrefix": f"http://127.0.0.1:{ports['ext']}"} for e in shipped["extenders"]
                ]
            else:
                config.pop("extenders")
            path = state / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            script("scheduler", str(state), name, str(path), K8S_SCHEDULER_PORT=str(ports[key]))
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the schedulers' self-signed serving certs
        figures: dict[str, Any] = {"nodes": a.nodes, "pods": a.pods, "load_before": os.getloadavg()[0]}
        for name, key in (("plain", "s2"), ("octacloud", "s1")):
            figures[name] = await run_one(api, name, f"https://127.0.0.1:{ports[key]}/metrics", token, ctx, a.pods)
        plain, octa = figures["plain"], figures["octacloud"]
        load = os.getloadavg()[0]
        print(f"\n{a.pods} pods of 2 octants on {a.nodes} nodes; load average {load:.2f} on {os.cpu_count()} cores")
        print("| scheduler | pods bound / s | attempt mean ms | SLI mean ms |\n|---|---|---|---|")
        for name in ("plain", "octacloud"):
            f = figures[name]
            print(f"| {name} | {f['pods_per_s']:.1f} | {f['attempt_ms']:.1f} | {f['sli_ms']:.1f} |")
        ratios = {k: octa[k] / plain[k] for k in ("pods_per_s", "attempt_ms", "sli_ms") if plain[k]}
        print(
            "| octacloud / plain | "
            + " | ".join(f"{ratios.get(k, float('nan')):.2f}" for k in ("pods_per_s", "attempt_ms", "sli_ms"))
            + " |"
        )
        figures["ratios"] = ratios
        recorder.save(figures)
        await api.close()
    finally:
        if extender is not None:
            extender.terminate()
            extender.wait(timeout=30)
        script("stop", str(state))


if __name__ == "__main__":
    asyncio.run(main())
