"""What one huge request costs the gateway: peak memory and time to refusal, with and without a key.

    .venv/bin/python bench/big_message.py [--gib 1] [--repository models]

Starts ``octacloud up`` (one CPU node, the MLP deployed), then sends, over gRPC and REST, a ``ModelInfer``
/ ``infer`` request of ``--gib`` GiB: first without a key, then with a valid one. The gateway should refuse
the first on its metadata / headers before the body is read (UNAUTHENTICATED / 401) and the second from
its declared size (RESOURCE_EXHAUSTED from the gRPC length prefix / 413 from Content-Length), so its peak
resident memory (``VmHWM`` of the ``up`` process) should not move by anything near the message's size.
Prints, per case: the answer, seconds to it, and the gateway's peak RSS before and after; then checks that
a normal inference still works. The client holds the message in memory (about twice its size). Last, a
message under the bounds (``--forward-mib``, 48 MiB) is carried whole to the replica, directly and through the
gateway: the time per message by each path and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from tritonclient.grpc import service_pb2 as pb

from benchutil import LocalCloud
from octacloud.security.internal_auth import HEADER

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


def chunks(total: int, size: int = 4 << 20) -> Iterator[bytes]:
    block = b"\0" * size
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield block if n == size else block[:n]
        sent += n


def forwarded(args: argparse.Namespace, key: str, secret: str, gateway: int, direct: int, pid: int) -> None:
    """A message under the bounds, carried whole: the replica reads all of it, then refuses its contents (one raw
    input for a model whose request names none) — the same answer by either path, so the time is the transport."""
    size = int(args.forward_mib * (1 << 20))
    message = pb.ModelInferRequest(model_name=args.model, raw_input_contents=[b"\0" * size]).SerializeToString()
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    paths = {
        "direct": (direct, ((HEADER, secret),)),
        "gateway": (gateway, (("authorization", f"Bearer {key}"),)),
    }
    seconds: dict[str, list[float]] = {where: [] for where in paths}
    answers: set[str] = set()
    for i in range(6):
        where = ("direct", "gateway")[(i + i // 2) % 2]  # direct, gateway, gateway, direct, direct, gateway
        port, metadata = paths[where]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            t = time.monotonic()
            try:
                call(message, metadata=metadata, timeout=300)
                answers.add("OK")
            except grpc.RpcError as e:
                answers.add(e.code().name)
            seconds[where].append(time.monotonic() - t)
    best = {where: min(v) for where, v in seconds.items()}
    print(
        f"a {args.forward_mib:g} MiB gRPC message carried whole (answers {sorted(answers)}): direct "
        f"{best['direct']:.3f} s, gateway {best['gateway']:.3f} s (best of 3 each; "
        f"{size / best['gateway'] / 2**20:.0f} MiB/s); gateway / direct {best['gateway'] / best['direct']:.2f}; "
        f"gateway peak RSS {peak_rss_mib(pid):.0f} MiB"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repository", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    p.add_argument("--model", default="mlp")
    p.add_argument(
        "--forward-mib",
        type=float,
        default=48.0,
        help="then a gRPC message of this size, under the bounds, sent to the replica directly and through the "
        "gateway (interleaved, 3 times each): seconds per message and the ratio",
    )
    args = p.parse_args()
    size = int(args.gib * GIB)
    models = Path(tempfile.mkdtemp(prefix="octacloud-bench-big-models-"))
    repo = models / "models"
    repo.mkdir()
    shutil.copytree(args.repository / args.model, repo / args.model)
    cloud = LocalCloud(repo, prefix="octacloud-bench-big-", cpu_milli=2000)
    try:
        cloud.start()
        key, url, grpc_port = cloud.key, cloud.url, cloud.grpc_port
        replica = cloud.deploy({"name": args.model, "model": args.model, "octants": 4})
        print(f"gateway pid {cloud.pid}: RSS {rss_mib(cloud.pid):.0f} MiB, peak {peak_rss_mib(cloud.pid):.0f} MiB")
        print(f"message: {size / GIB:g} GiB")
        rows: list[dict[str, object]] = []

        message = pb.ModelInferRequest(model_name=args.model, raw_input_contents=[b"\0" * size]).SerializeToString()
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for label, metadata in (("gRPC, no key", ()), ("gRPC, valid key", (("authorization", f"Bearer {key}"),))):
                before = peak_rss_mib(cloud.pid)
                t = time.monotonic()
                try:
                    call(message, metadata=metadata, timeout=120)
                    answer = "OK"
                except grpc.RpcError as e:
                    answer = f"{e.code().name}: {e.details()}"
                rows.append(row(label, answer, t, before, cloud.pid))
        del message

        for label, headers in (
            ("REST, no key", {}),
            ("REST, valid key", {"Authorization": f"Bearer {key}"}),
        ):
            before = peak_rss_mib(cloud.pid)
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
            rows.append(row(label, answer, t, before, cloud.pid))

        for r_ in rows:
            print(json.dumps(r_))
        forwarded(args, key, cloud.secret, grpc_port, int(replica["grpc_port"]), cloud.pid)
        body = {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]}
        r = httpx.post(f"{url}/v2/models/{args.model}/infer", json=body, headers={"Authorization": f"Bearer {key}"})
        print(f"a normal inference afterwards: {r.status_code}; gateway RSS {rss_mib(cloud.pid):.0f} MiB")
    finally:
        cloud.stop()
        shutil.rmtree(models, ignore_errors=True)


if __name__ == "__main__":
    main()
