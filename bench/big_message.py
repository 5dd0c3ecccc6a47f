"""What one huge request costs the gateway: peak memory and time to refusal, with and without a key.

    .venv/bin/python bench/big_message.py [--gib 1] [--repository models]

Starts ``octacloud up`` (one CPU node, the MLP deployed), then sends, over gRPC and REST, a ``ModelInfer``
/ ``infer`` request of ``--gib`` GiB: first without a key, then with a valid one. The gateway should refuse
the first on its metadata / headers before the body is read (UNAUTHENTICATED / 401) and the second from
its declared size (RESOURCE_EXHAUSTED from the gRPC length prefix / 413 from Content-Length), so its peak
resident memory (``VmHWM`` of the ``up`` process) should not move by anything near the message's size.
Prints, per case: the answer, seconds to it, and the gateway's peak RSS before and after; then checks that
a normal inference still works. The client holds the message in memory (about twice its size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from tritonclient.grpc import service_pb2 as pb

from benchutil import free_port

GIB = 1 << 30


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def row(case: str, answer: str, started: float, peak_before: float, pid: int) -> dict[str, object]:
    return {
        "case": case,
        "answer": answer,
        "s": round(time.monotonic() - started, 3),
        "peak_before_mib": round(peak_before),
        "peak_after_mib": round(peak_rss_mib(pid)),
    }


def admin(url: str, key: str, method: str, path: str, body: object = None) -> object:
    r = httpx.request(method, f"{url}/admin{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def chunks(total: int, size: int = 4 << 20) -> Iterator[bytes]:
    block = b"\0" * size
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield block if n == size else block[:n]
        sent += n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repository", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    p.add_argument("--model", default="mlp")
    args = p.parse_args()
    size = int(args.gib * GIB)
    work = Path(tempfile.mkdtemp(prefix="octacloud-bench-big-"))
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(args.repository / args.model, repo / args.model)
    fleet = work / "fleet.yaml"
    fleet.write_text(
        "nodes:\n  - name: bench\n    cpu_milli: 2000\n    memory_mib: 16384\n"
        "    gpu_count: 1\n    gpu_model: cpu\n    gpu_memory_mib: 8192\n"
    )
    http_port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    log = (work / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "octacloud", "up", "--repository", str(repo), "--fleet", str(fleet), "--state-dir",
         str(work / "var"), "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--interval", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        key = ""
        while True:
            try:
                key = (work / "var" / "admin.key").read_text().strip()
                admin(url, key, "GET", "/deployments")
                break
            except (OSError, httpx.HTTPError):
                if time.monotonic() > deadline or up.poll() is not None:
                    raise SystemExit(f"octacloud up did not start; see {work / 'up.log'}") from None
                time.sleep(0.3)
        admin(url, key, "POST", "/deployments", {"name": args.model, "model": args.model, "octants": 4})
        while True:
            d = admin(url, key, "GET", f"/deployments/{args.model}")
            if any(r["state"] == "ready" for r in d["instances"]):  # type: ignore[index]
                break
            if time.monotonic() > deadline + 60:
                raise SystemExit("the deployment did not become ready")
            time.sleep(0.3)
        print(f"gateway pid {up.pid}: RSS {rss_mib(up.pid):.0f} MiB, peak {peak_rss_mib(up.pid):.0f} MiB")
        print(f"message: {size / GIB:g} GiB")
        rows: list[dict[str, object]] = []

        message = pb.ModelInferRequest(model_name=args.model, raw_input_contents=[b"\0" * size]).SerializeToString()
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for label, metadata in (("gRPC, no key", ()), ("gRPC, valid key", (("authorization", f"Bearer {key}"),))):
                before = peak_rss_mib(up.pid)
                t = time.monotonic()
                try:
                    call(message, metadata=metadata, timeout=120)
                    answer = "OK"
                except grpc.RpcError as e:
                    answer = f"{e.code().name}: {e.details()}"
                rows.append(row(label, answer, t, before, up.pid))
        del message

        for label, headers in (
            ("REST, no key", {}),
            ("REST, valid key", {"Authorization": f"Bearer {key}"}),
        ):
            before = peak_rss_mib(up.pid)
            t = time.monotonic()
            try:
                r = httpx.post(
                    f"{url}/v2/models/{args.model}/infer",
                    content=chunks(size),
                    headers={**headers, "Content-Type": "application/json", "Content-Length": str(size)},
                    timeout=120,
                )
                answer = f"{r.status_code}: {r.text[:80]}"
            except httpx.HTTPError as e:
                answer = f"{type(e).__name__}: {e}"
            rows.append(row(label, answer, t, before, up.pid))

        for r_ in rows:
            print(json.dumps(r_))
        body = {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]}
        r = httpx.post(f"{url}/v2/models/{args.model}/infer", json=body, headers={"Authorization": f"Bearer {key}"})
        print(f"a normal inference afterwards: {r.status_code}; gateway RSS {rss_mib(up.pid):.0f} MiB")
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        subprocess.run([sys.executable, "-m", "octacloud", "down", "--state-dir", str(work / "var")],
                       capture_output=True, timeout=60, check=False)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
