"""A small gRPC load generator for the benches (Open Inference Protocol ``ModelInfer``, raw FP32 input).

    python bench/loadgen.py TARGET MODEL NAME:DIMS --concurrency 8 --seconds 3 [--key KEY]
    python bench/loadgen.py TARGET MODEL NAME:DIMS --rate 2000 --seconds 3      # open loop, Poisson arrivals

Prints one JSON object: ``throughput`` (answered calls per second), ``p50_ms``/``p99_ms`` of the answered
calls, ``refused`` (calls answered UNAVAILABLE or RESOURCE_EXHAUSTED: shed load), ``failed`` (any other
error) and, open loop, ``client_lag_p99_ms``: how late this client itself sent its requests (latencies are
measured from the scheduled time, so a client that falls behind inflates them; a large lag voids the point).
Requests are serialised once; with ``--key`` every call carries ``authorization: Bearer KEY`` metadata (what
perf_analyzer 2.51 cannot send over gRPC). The first second is a warm-up, not counted.

As an open-loop generator this one falls behind above a few thousand calls a second (its ``client_lag_p99_ms``
shows it); ``bench/openloop.py`` (several processes, raw sockets, its own HTTP/2 client) keeps up, over HTTP
and gRPC, and is what ``bench/knee.py`` sweeps the load with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

SHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def request_bytes(model: str, shape: str) -> bytes:
    name, dims = shape.split(":")
    full = [1, *(int(d) for d in dims.split(","))]
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="FP32", shape=full)
    request.raw_input_contents.append(np.random.default_rng(0).random(full, dtype=np.float32).tobytes())
    out: bytes = request.SerializeToString()
    return out


async def run(args: argparse.Namespace) -> dict[str, float]:
    body = request_bytes(args.model, args.shape)
    metadata = (("authorization", f"Bearer {args.key}"),) if args.key else ()
    metadata += tuple(tuple(item.split("=", 1)) for item in args.metadata)  # type: ignore[misc]
    latencies: list[float] = []
    lags: list[float] = []  # open loop: how late this client sent each request (it must keep up with its schedule)
    counts = {"refused": 0, "failed": 0}
    async with grpc.aio.insecure_channel(args.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        await call(body, metadata=metadata, timeout=30)  # connected before the clock starts
        loop = asyncio.get_running_loop()
        start = loop.time() + 1.0
        end = start + args.seconds

        async def one(t0: float) -> None:
            if args.rate and t0 >= start:
                lags.append(loop.time() - t0)
            try:
                await call(body, metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as e:
                if t0 >= start:
                    counts["refused" if e.code() in SHED else "failed"] += 1
                return
            if t0 >= start:
                latencies.append(loop.time() - t0)

        if args.rate:
            rng = random.Random(0)
            tasks: set[asyncio.Task[None]] = set()
            t = loop.time()
            while t < end:
                t += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, t - loop.time()))
                task = asyncio.ensure_future(one(t))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=35)
        else:

            async def worker() -> None:
                while (t0 := loop.time()) < end:
                    await one(t0)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    latencies.sort()
    n = len(latencies)
    return {
        "throughput": n / args.seconds,
        "p50_ms": latencies[n // 2] * 1e3 if n else float("nan"),
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan"),
        "refused": counts["refused"] / args.seconds,
        "failed": counts["failed"] / args.seconds,
        "client_lag_p99_ms": sorted(lags)[int(len(lags) * 0.99)] * 1e3 if lags else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target")
    p.add_argument("model")
    p.add_argument("shape", help="the input as NAME:DIMS without the batch dim, e.g. input:256")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second (Poisson)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--key", default="")
    p.add_argument("--metadata", action="append", default=[], help="NAME=VALUE metadata on every call (repeatable)")
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
