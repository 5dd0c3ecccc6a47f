"""One tenant's inputs never change another's int8 results.

A dynamically quantized model (``DynamicQuantizeLinear``) computes one activation scale over the whole batch:
batched with a tenant's large inputs, another tenant's int8 results changed (200 of 200, sign flips). Such
models are detected from their graph and their requests never share a batch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from octacloud.serving import ControlMode, DataPlane, InferenceRequest, ModelRepository, Tensor
from octacloud.serving.batching.policy import BatchingSettings, BatchPolicy, Pending
from octacloud.serving.onnxops import couples_rows, op_types

MODELS = Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))


def need(*names: str) -> None:
    missing = [n for n in names if not (MODELS / n / "1" / "model.onnx").is_file()]
    if missing:
        pytest.skip(f"the example model repository lacks {missing} at {MODELS}: run `make models`")


def request(model: str, x: np.ndarray) -> InferenceRequest:
    return InferenceRequest(model, [Tensor("input", "FP32", x.shape, x)])


def test_row_coupling_is_read_from_the_graph_not_the_name(tmp_path: Path) -> None:
    need("mlp", "mlp_int8", "resnet50_int8")
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= op_types(MODELS / "mlp_int8" / "1" / "model.onnx")
    assert couples_rows(MODELS / "mlp_int8" / "1" / "model.onnx")
    assert not couples_rows(MODELS / "mlp" / "1" / "model.onnx")
    assert not couples_rows(MODELS / "resnet50_int8" / "1" / "model.onnx")  # static scales: rows independent
    renamed = tmp_path / "model.onnx"  # a dynamically quantized model under an innocent name
    shutil.copy(MODELS / "mlp_int8" / "1" / "model.onnx", renamed)
    assert couples_rows(renamed)


def test_an_isolating_policy_never_batches_two_requests() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=64, max_queue_delay_us=2000, isolate_requests=True))
    queue = [Pending(arrival=0.0, rows=2), Pending(arrival=0.0001, rows=1), Pending(arrival=0.0002, rows=1)]
    assert policy.decide(queue, now=0.0003, cap=64).batch == (0,)
    mixing = BatchPolicy(BatchingSettings(max_batch_size=64, max_queue_delay_us=2000))
    assert mixing.decide([*queue, Pending(arrival=0.0003)], now=0.0003, cap=64).batch == (0, 1, 2, 3)


async def _differing(dp: DataPlane, model: str, rounds: int) -> tuple[int, int]:
    """(rounds where tenant A's result differed from its result alone, the largest batch run)."""
    rng = np.random.default_rng(7)
    a = rng.normal(size=(1, 256)).astype(np.float32)
    b = (rng.normal(size=(1, 256)) * 1000).astype(np.float32)
    alone = (await dp.infer(request(model, a))).outputs[0].data
    differing = 0
    for _ in range(rounds):
        results = await asyncio.gather(dp.infer(request(model, a)), *(dp.infer(request(model, b)) for _ in range(7)))
        if not np.array_equal(results[0].outputs[0].data, alone):
            differing += 1
    stats = dp.repository.get(model).stats
    return differing, max(stats.batch_stats)


async def test_a_tenants_int8_results_do_not_depend_on_anothers_inputs() -> None:
    need("mlp", "mlp_int8")
    repo = ModelRepository(MODELS, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["mlp", "mlp_int8"])
    try:
        dp = DataPlane(repo)
        assert repo.get("mlp_int8").isolates_requests and not repo.get("mlp").isolates_requests
        differing, largest = await _differing(dp, "mlp_int8", 100)
        assert (differing, largest) == (0, 1)
        _, largest_fp32 = await _differing(dp, "mlp", 20)
        assert largest_fp32 > 1  # the same load does batch a model whose rows are independent
    finally:
        await repo.close()
