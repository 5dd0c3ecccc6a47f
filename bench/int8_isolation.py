"""The cost of isolating requests of a dynamically quantized model: throughput with and without, in one run.

    .venv/bin/python bench/int8_isolation.py [--models DIR] [--model mlp_int8] [--concurrency 1 8 32] [--seconds 4]

A dynamically quantized model computes one activation scale per batch, so octacloud never batches two of its
requests together (``isolate_requests``); ``parameters { key: "batch_isolation" value { string_value: "none" } }``
in its config turns that off. This loads the model twice in one process (isolated, and mixing batches), drives
each with the same closed-loop load of batch-1 requests through the DataPlane, alternating rounds so both see
the same machine, and prints requests/s, p50/p99 and the ratio. The load average is printed: this is a shared
machine, compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from octacloud.serving import ControlMode, DataPlane, InferenceRequest, ModelRepository, Tensor

MIXING = '\nparameters { key: "batch_isolation" value { string_value: "none" } }\n'


def _repository(models: Path, model: str, root: Path) -> None:
    shutil.copytree(models / model, root / "isolated")
    shutil.copytree(models / model, root / "mixing")
    for name in ("isolated", "mixing"):
        config = root / name / "config.pbtxt"
        text = config.read_text().replace(f'name: "{model}"', f'name: "{name}"')
        config.write_text(text + (MIXING if name == "mixing" else ""))


async def _drive(dp: DataPlane, model: str, x: np.ndarray, concurrency: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    name = dp.model_metadata(model).inputs[0].name

    async def client() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await dp.infer(InferenceRequest(model, [Tensor(name, "FP32", x.shape, x)]))
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    parser.add_argument("--model", default="mlp_int8")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _repository(args.models, args.model, root)
        repo = ModelRepository(root, control_mode=ControlMode.EXPLICIT, threads=args.threads)
        await repo.start(["isolated", "mixing"])
        try:
            dp = DataPlane(repo)
            assert repo.get("isolated").isolates_requests and not repo.get("mixing").isolates_requests
            shape = tuple(d if d > 0 else 1 for d in dp.model_metadata("isolated").inputs[0].shape)
            x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
            print(f"model {args.model}, batch-1 requests, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}")
            print(f"{'c':>4} {'isolated req/s':>15} {'mixing req/s':>13} {'ratio':>6} {'p50/p99 ms isolated':>20} "
                  f"{'p50/p99 ms mixing':>18}")  # fmt: skip
            for c in args.concurrency:
                runs: dict[str, list[float]] = {"isolated": [], "mixing": []}
                for _ in range(args.rounds):
                    for model in ("isolated", "mixing"):
                        runs[model] += await _drive(dp, model, x, c, args.seconds / args.rounds)
                rate = {m: len(v) / args.seconds for m, v in runs.items()}

                def pct(v: list[float]) -> str:
                    q = statistics.quantiles(v, n=100)
                    return f"{q[49] * 1e3:.2f}/{q[98] * 1e3:.2f}"

                print(
                    f"{c:>4} {rate['isolated']:>15.0f} {rate['mixing']:>13.0f} "
                    f"{rate['isolated'] / rate['mixing']:>6.2f} {pct(runs['isolated']):>20} {pct(runs['mixing']):>18}"
                )
            print(f"load {os.getloadavg()[0]:.2f}")
        finally:
            await repo.close()


if __name__ == "__main__":
    asyncio.run(main())
