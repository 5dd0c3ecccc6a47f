"""Loading and freeing a model version happen off the replica's event loop: a tokenizer's load, a warm-up, and
freeing a model (onnxruntime takes about 20 ms for ResNet-50; a process-mode model's children must exit) never
stall the replica's other models."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from octacloud.serving import (
    ControlMode,
    DataPlane,
    InferenceRequest,
    ModelConfigError,
    ModelRepository,
    Tensor,
)
from octacloud.serving.compute import ComputeProcess
from octacloud.serving.testing import FakeRuntimeFactory, runtimes_with_fakes, write_fake_model
from octacloud.serving.text import TextInput
from tests.serving.test_compute_process import wait_gone


def explicit(root: Path) -> ModelRepository:
    return ModelRepository(
        root, control_mode=ControlMode.EXPLICIT, runtimes=runtimes_with_fakes(FakeRuntimeFactory()), threads=1
    )


async def longest_stall(dp: DataPlane, work: asyncio.Future[None]) -> float:
    """Serve model ``other`` in a loop until ``work`` is done; the longest gap between two answers, in s."""
    longest, last = 0.0, time.monotonic()
    while not work.done():
        x = np.ones((1, 4), np.float32)
        assert (await dp.infer(InferenceRequest("other", [Tensor.of("INPUT0", x)]))).outputs[0].data.sum() == 4
        await asyncio.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


@pytest.mark.parametrize("compute", ["replica", "process"])
async def test_unloading_frees_the_model_off_the_loop(tmp_path: Path, compute: str) -> None:
    """A model that takes 2 s to free (a large one; in process mode, its child takes that long to exit)."""
    slow_close = 'parameters { key: "close_delay_ms" value { string_value: "2000" } }\n'
    mode = f'parameters {{ key: "compute" value {{ string_value: "{compute}" }} }}\n'
    write_fake_model(tmp_path, "large", "echo", extra=mode + slow_close)
    write_fake_model(tmp_path, "other", "echo")
    r = explicit(tmp_path)
    await r.start(load=["*"])
    dp = DataPlane(r)
    try:
        runtime = r.get("large").runtime
        await dp.infer(InferenceRequest("large", [Tensor.of("INPUT0", np.ones((1, 4), np.float32))]))
        unloading = asyncio.ensure_future(r.unload("large"))
        assert await longest_stall(dp, unloading) < 1.0
        await unloading
        if isinstance(runtime, ComputeProcess):
            assert all(wait_gone(p) for p in runtime.pids)
        else:
            assert runtime.closed  # type: ignore[attr-defined]
    finally:
        await r.close()


@pytest.mark.parametrize("compute", ["replica", "process"])
async def test_a_failed_warm_up_frees_the_model_off_the_loop(tmp_path: Path, compute: str) -> None:
    """A version whose warm-up fails is freed (2 s here)."""
    warm_up_fails = (
        'model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [4] '
        "random_data: true } } } ]\n"
        'parameters { key: "close_delay_ms" value { string_value: "2000" } }\n'
        f'parameters {{ key: "compute" value {{ string_value: "{compute}" }} }}\n'
    )
    write_fake_model(tmp_path, "bad", "error", extra=warm_up_fails)
    write_fake_model(tmp_path, "other", "echo")
    r = explicit(tmp_path)
    await r.start(load=["other"])
    dp = DataPlane(r)
    try:
        loading = asyncio.ensure_future(r.load("bad"))
        assert await longest_stall(dp, loading) < 1.0
        with pytest.raises(ModelConfigError, match="warm-up failed"):
            await loading
    finally:
        await r.close()


async def test_loading_a_version_reads_its_tokenizer_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer takes 30-40 ms to load (here: 2 s)."""

    def slow_tokenizer(version_dir: Path, config: object) -> None:
        time.sleep(2)

    monkeypatch.setattr(TextInput, "load", staticmethod(slow_tokenizer))
    write_fake_model(tmp_path, "text", "echo")
    write_fake_model(tmp_path, "other", "echo")
    r = explicit(tmp_path)
    await r.start(load=["other"])
    dp = DataPlane(r)
    try:
        loading = asyncio.ensure_future(r.load("text"))
        assert await longest_stall(dp, loading) < 1.0
        await loading
        assert r.get("text").state.value == "READY"
    finally:
        await r.close()
