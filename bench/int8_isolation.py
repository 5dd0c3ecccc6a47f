"""What isolating int8 requests costs, per scheme: throughput side by side in one run.

    .venv/bin/python bench/int8_isolation.py [--models DIR] [--model mlp] [--concurrency 1 8 32] [--seconds 4]

From the repository's fp32 ``<model>`` this builds, in a temporary repository, the int8 graph two ways and
serves it five ways in one process:

- ``isolated``: ``quantize_dynamic``'s graph (one activation scale per batch), requests of unknown tenant:
  octacloud finds the graph couples rows and never batches two of them (what a model with per-batch scales gets
  without a gateway in front, and what every dynamically quantized model got before per-row scales);
- ``per-tenant``: the same graph, each client one of ``--tenants`` tenants (as the gateway's header says):
  batched only with the same tenant's requests;
- ``mixing``: the same graph with ``batch_isolation: "none"``: batched across tenants, and a request's result
  depends on the others in its batch (the unsafe upper bound);
- ``per-row``: the same graph after the toolchain's per-row activation scales (toolchain/rowscales.py): batched
  across tenants, a request's result bit-identical whatever it is batched with;
- ``per-row-d0``: the same with ``max_queue_delay_microseconds: 0`` (dispatch at once when an instance is
  free; batches form only while it is busy): a lone request no longer waits the 2 ms delay for company.

Each is driven with the same closed-loop load of batch-1 requests through the DataPlane, the schemes taking
turns in every round so that all see the same machine; requests/s, p50/p99 and the ratios to ``isolated`` and
``mixing`` are printed with the load average. Needs the ``build`` extra (``onnx``). On a shared machine compare
within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from octacloud.serving import ControlMode, DataPlane, InferenceRequest, ModelRepository, Tensor
from octacloud.serving.types import numpy_dtype

SCHEMES = ("isolated", "per-tenant", "mixing", "per-row", "per-row-d0")
PER_BATCH = ("isolated", "per-tenant", "mixing")
"""The schemes serving quantize_dynamic's graph as it is."""
MIXING = '\nparameters { key: "batch_isolation" value { string_value: "none" } }\n'


def _latest(models: Path, model: str) -> Path:
    versions = [p for p in (models / model).iterdir() if p.name.isdigit() and (p / "model.onnx").is_file()]
    if not versions:
        raise SystemExit(f"{models / model} holds no built version: run `octacloud models build --out {models}`")
    return max(versions, key=lambda p: int(p.name))


def _repository(models: Path, model: str, root: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from octacloud.toolchain.rowscales import per_row_activation_scales
    from octacloud.toolchain.variants import REDUCE_RANGE, without_initializer_shapes

    fp32 = _latest(models, model)
    config = (models / model / "config.pbtxt").read_text()
    for name in SCHEMES:
        (root / name / "1").mkdir(parents=True)
        for extra in fp32.iterdir():  # the tokenizer of a text model, and the like
            if extra.name != "model.onnx":
                (root / name / "1" / extra.name).write_bytes(extra.read_bytes())
        text = config.replace(f'name: "{model}"', f'name: "{name}"')
        if name == "per-row-d0":
            text = text.replace("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 0")
        (root / name / "config.pbtxt").write_text(text + (MIXING if name == "mixing" else ""))
    per_batch = root / "isolated" / "1" / "model.onnx"
    quantize_dynamic(
        without_initializer_shapes(onnx.load(str(fp32 / "model.onnx"))),
        str(per_batch),
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=REDUCE_RANGE,
    )
    for name in PER_BATCH[1:]:
        (root / name / "1" / "model.onnx").write_bytes(per_batch.read_bytes())
    graph = onnx.load(str(per_batch))
    rewrite = per_row_activation_scales(graph)
    for name in SCHEMES[len(PER_BATCH) :]:
        onnx.save(graph, str(root / name / "1" / "model.onnx"))
    print(f"per-row: {rewrite.rewritten} activation(s) rewritten, {len(rewrite.kept)} kept per batch")


def _inputs(dp: DataPlane, model: str, seq: int) -> list[Tensor]:
    rng = np.random.default_rng(0)
    tensors = []
    for meta in dp.model_metadata(model).inputs:
        shape = tuple(d if d > 0 else (1 if i == 0 else seq) for i, d in enumerate(meta.shape))
        if meta.datatype == "FP32":
            x = rng.normal(size=shape).astype(np.float32)
        elif meta.name == "attention_mask":
            x = np.ones(shape, np.int64)
        elif meta.name == "token_type_ids":
            x = np.zeros(shape, np.int64)
        else:
            x = rng.integers(1000, 20000, size=shape).astype(numpy_dtype(meta.datatype))
        tensors.append(Tensor(meta.name, meta.datatype, x.shape, x))
    return tensors


async def _drive(
    dp: DataPlane, model: str, inputs: list[Tensor], concurrency: int, seconds: float, tenants: int
) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def client(tenant: str) -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await dp.infer(InferenceRequest(model, inputs, tenant=tenant))
            latencies.append(time.perf_counter() - t)

    who = [f"tenant-{i % tenants}" if tenants else "" for i in range(concurrency)]
    await asyncio.gather(*(client(t) for t in who))
    return latencies


def _pct(v: list[float]) -> str:
    q = statistics.quantiles(v, n=100)
    return f"{q[49] * 1e3:.2f}/{q[98] * 1e3:.2f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("OCTACLOUD_MODELS", "models")))
    parser.add_argument("--model", default="mlp", help="the fp32 model to quantize (mlp, minilm, bert_base)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=4.0, help="per scheme and concurrency")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32, help="tokens per request of a text model")
    parser.add_argument("--tenants", type=int, default=4, help="tenants the clients of per-tenant belong to")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _repository(args.models, args.model, root)
        repo = ModelRepository(root, control_mode=ControlMode.EXPLICIT, threads=args.threads)
        await repo.start(list(SCHEMES))
        try:
            dp = DataPlane(repo)
            per_tenant = {s: repo.get(s).isolates_tenants for s in SCHEMES}
            assert per_tenant == {s: s in PER_BATCH[:2] for s in SCHEMES}, per_tenant
            inputs = _inputs(dp, "isolated", args.seq)
            print(
                f"model {args.model} int8, batch-1 requests, {args.threads} thread(s), per-tenant over "
                f"{args.tenants} tenants, load {os.getloadavg()[0]:.2f}"
            )
            print(f"{'c':>4} {'scheme':>11} {'req/s':>8} {'÷ isolated':>11} {'÷ mixing':>9} {'p50/p99 ms':>14}")
            for c in args.concurrency:
                runs: dict[str, list[float]] = {s: [] for s in SCHEMES}
                for r in range(args.rounds):
                    turn = SCHEMES[r % len(SCHEMES) :] + SCHEMES[: r % len(SCHEMES)]  # who goes first rotates
                    for scheme in turn:
                        tenants = 0 if scheme == "isolated" else args.tenants
                        runs[scheme] += await _drive(dp, scheme, inputs, c, args.seconds / args.rounds, tenants)
                rate = {s: len(v) / args.seconds for s, v in runs.items()}
                for s in SCHEMES:
                    print(
                        f"{c:>4} {s:>11} {rate[s]:>8.0f} {rate[s] / rate['isolated']:>11.2f} "
                        f"{rate[s] / rate['mixing']:>9.2f} {_pct(runs[s]):>14}"
                    )
            print(f"load {os.getloadavg()[0]:.2f}")
        finally:
            await repo.close()


if __name__ == "__main__":
    asyncio.run(main())
