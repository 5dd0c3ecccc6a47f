"""The model repository: layout, config.pbtxt, auto-complete, version policies, control modes, bad models,
and reloads that never drop a request in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from octacloud.serving import (
    ControlMode,
    DataPlane,
    InferenceRequest,
    ModelConfigError,
    ModelNotFoundError,
    ModelNotReadyError,
    ModelRepository,
    NotAllowedError,
    Tensor,
)
from octacloud.serving.repository.config import PARAM_BYTES_PER_SAMPLE
from octacloud.serving.testing import (
    FakeRuntimeFactory,
    add_onnx,
    fake_config,
    runtimes_with_fakes,
    write_fake_model,
    write_onnx_model,
)


def repository(root: Path, fakes: FakeRuntimeFactory, **kw: object) -> ModelRepository:
    return ModelRepository(root, runtimes=runtimes_with_fakes(fakes), threads=1, **kw)  # type: ignore[arg-type]


def echo(model: str, version: str = "", n: int = 1) -> InferenceRequest:
    return InferenceRequest(model, [Tensor.of("INPUT0", np.ones((n, 4), np.float32))], version)


async def test_loads_every_model_and_autocompletes_from_the_onnx_graph(repo: Path, fakes: FakeRuntimeFactory) -> None:
    r = repository(repo, fakes)
    await r.start()
    try:
        assert [(e.name, e.version, e.state) for e in r.index()] == [
            ("add", "1", "READY"),
            ("add_auto", "1", "READY"),
            ("slow", "1", "READY"),
            ("sum", "1", "READY"),
        ]
        auto = r.get("add_auto").config
        assert auto.platform == "onnxruntime_onnx"
        assert auto.max_batch_size == 32  # the first dim is dynamic
        assert [(i.name, list(i.dims)) for i in auto.input] == [("INPUT0", [4]), ("INPUT1", [4])]
        assert auto.dynamic_batching.max_queue_delay_microseconds == 2000
        assert r.get("add").bytes_per_sample >= 3 * 4 * 4  # measured at warm-up: at least its I/O
    finally:
        await r.close()


async def test_a_fixed_first_dim_means_no_batching(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    write_onnx_model(tmp_path, "fixed", add_onnx(batch=False))
    r = repository(tmp_path, fakes)
    await r.start()
    try:
        assert r.get("fixed").config.max_batch_size == 0
        out = await DataPlane(r).infer(
            InferenceRequest(
                "fixed", [Tensor.of("INPUT0", np.ones(4, np.float32)), Tensor.of("INPUT1", np.ones(4, np.float32))]
            )
        )
        np.testing.assert_array_equal(out.outputs[0].data, np.full(4, 2, np.float32))
    finally:
        await r.close()


BAD_MODELS = {
    "no_version": (None, "has no version folder"),
    "no_file": ("", "model.onnx is missing"),
    "broken_onnx": (b"not an onnx file", "onnxruntime cannot load it"),
    "unknown_field": ('backend: "onnxruntime"\nmax_batchsize: 4', "max_batchsize"),
    "wrong_shape": (
        'backend: "onnxruntime"\nmax_batch_size: 4\ninput [{name: "INPUT0" data_type: TYPE_FP32 '
        'dims: [5]}, {name: "INPUT1" data_type: TYPE_FP32 dims: [4]}]',
        "dims [5]",
    ),
    "wrong_dtype": (
        'max_batch_size: 4\ninput [{name: "INPUT0" data_type: TYPE_INT32 dims: [4]}, '
        '{name: "INPUT1" data_type: TYPE_FP32 dims: [4]}]',
        "TYPE_INT32 but the model has FP32",
    ),
    "missing_input": (
        'max_batch_size: 4\ninput [{name: "INPUT0" data_type: TYPE_FP32 dims: [4]}]',
        "input 'INPUT1' (FP32 [-1, 4]) is missing",
    ),
    "wrong_name": ('name: "other"', "does not match the model's folder"),
    "unknown_backend": ('backend: "tensorflow"', "'tensorflow' is not supported"),
    "bad_param": (
        f'parameters {{ key: "{PARAM_BYTES_PER_SAMPLE}" value {{ string_value: "lots" }} }}',
        "must be an integer",
    ),
}


async def test_each_bad_model_gets_one_clear_error_and_the_others_load(
    tmp_path: Path, fakes: FakeRuntimeFactory
) -> None:
    write_onnx_model(tmp_path, "good", add_onnx())
    for name, (content, _) in BAD_MODELS.items():
        folder = tmp_path / name
        folder.mkdir()
        if name == "no_version":
            continue
        (folder / "1").mkdir()
        if isinstance(content, bytes):
            (folder / "1" / "model.onnx").write_bytes(content)
        elif content:
            (folder / "1" / "model.onnx").write_bytes(add_onnx())
            (folder / "config.pbtxt").write_text(content)
    r = repository(tmp_path, fakes)
    await r.start()
    try:
        index = {e.name: e for e in r.index()}
        assert index["good"].state == "READY"
        for name, (_, message) in BAD_MODELS.items():
            assert index[name].state == "UNAVAILABLE", name
            assert message in index[name].reason, (name, index[name].reason)
            assert name in index[name].reason  # one clear error that names the model
            with pytest.raises(ModelNotReadyError, match="not available"):
                r.get(name)
        assert await DataPlane(r).infer(
            InferenceRequest(
                "good",
                [Tensor.of("INPUT0", np.ones((1, 4), np.float32)), Tensor.of("INPUT1", np.ones((1, 4), np.float32))],
            )
        )
    finally:
        await r.close()


async def test_a_missing_repository_is_an_error(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    with pytest.raises(ModelConfigError, match="is not a directory"):
        await repository(tmp_path / "nope", fakes).start()


@pytest.mark.parametrize(
    ("policy", "loaded", "default"),
    [
        ("", ["3"], "3"),
        ("version_policy: { latest: { num_versions: 2 } }", ["2", "3"], "3"),
        ("version_policy: { all: {} }", ["1", "2", "3"], "3"),
        ("version_policy: { specific: { versions: [1, 2] } }", ["1", "2"], "2"),
    ],
)
async def test_version_policies(
    tmp_path: Path, fakes: FakeRuntimeFactory, policy: str, loaded: list[str], default: str
) -> None:
    write_fake_model(tmp_path, "echo", "echo", versions=(1, 2, 3), extra=policy)
    r = repository(tmp_path, fakes)
    await r.start()
    try:
        assert [m.version for m in r.versions("echo")] == loaded
        assert r.get("echo").version == default
        response = await DataPlane(r).infer(echo("echo", loaded[0]))
        assert response.version == loaded[0]
        with pytest.raises(ModelNotFoundError, match="no version '9'"):
            r.get("echo", "9")
    finally:
        await r.close()


async def test_specific_version_that_does_not_exist(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    write_fake_model(tmp_path, "echo", "echo", versions=(1,), extra="version_policy: { specific: { versions: [4] } }")
    r = repository(tmp_path, fakes)
    await r.start()
    try:
        assert "names version(s) [4]" in r.index()[0].reason
    finally:
        await r.close()


async def test_explicit_mode_loads_and_unloads_on_request(repo: Path, fakes: FakeRuntimeFactory) -> None:
    r = repository(repo, fakes, control_mode=ControlMode.EXPLICIT)
    await r.start(["sum"])
    try:
        assert [e.name for e in r.index(ready_only=True)] == ["sum"]
        with pytest.raises(ModelNotReadyError, match="not loaded"):
            r.get("add")
        await r.load("add")
        assert r.get("add").version == "1"
        await r.unload("add")
        with pytest.raises(ModelNotReadyError):
            r.get("add")
        with pytest.raises(ModelNotFoundError):
            await r.load("nope")
    finally:
        await r.close()


async def test_mode_none_refuses_the_repository_api(repo: Path, fakes: FakeRuntimeFactory) -> None:
    r = repository(repo, fakes)
    await r.start()
    try:
        with pytest.raises(NotAllowedError, match="explicit"):
            await r.load("add")
        with pytest.raises(NotAllowedError):
            await r.unload("add")
    finally:
        await r.close()


async def test_reload_swaps_versions_without_dropping_requests_in_flight(
    tmp_path: Path, fakes: FakeRuntimeFactory
) -> None:
    write_fake_model(tmp_path, "slow", "slow", extra='parameters { key: "delay_ms" value { string_value: "200" } }')
    r = repository(tmp_path, fakes, control_mode=ControlMode.EXPLICIT)
    await r.start(["slow"])
    dp = DataPlane(r)
    try:
        old = r.get("slow")
        inflight = [asyncio.ensure_future(dp.infer(echo("slow"))) for _ in range(6)]
        await asyncio.sleep(0.05)
        (tmp_path / "slow" / "2").mkdir()  # a new version appears: latest(1) moves to it
        await r.load("slow")
        assert r.get("slow").version == "2"
        new = await dp.infer(echo("slow"))
        assert new.version == "2"
        done = await asyncio.gather(*inflight)
        assert [d.version for d in done] == ["1"] * 6  # every request in flight finished on the old version
        await asyncio.sleep(0.05)
        assert old.state.value == "UNAVAILABLE"
        assert fakes.created[0].closed
    finally:
        await r.close()


async def test_unload_waits_for_requests_in_flight(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    write_fake_model(tmp_path, "slow", "slow")
    r = repository(tmp_path, fakes, control_mode=ControlMode.EXPLICIT)
    await r.start(["*"])
    dp = DataPlane(r)
    try:
        inflight = asyncio.ensure_future(dp.infer(echo("slow")))
        await asyncio.sleep(0.02)
        await r.unload("slow")
        assert (await inflight).version == "1"
        with pytest.raises(ModelNotReadyError):
            await dp.infer(echo("slow"))
    finally:
        await r.close()


async def test_poll_mode_applies_changes(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    write_fake_model(tmp_path, "echo", "echo")
    r = repository(tmp_path, fakes, control_mode=ControlMode.POLL, poll_interval_s=3600)
    await r.start()
    try:
        (tmp_path / "echo" / "2").mkdir()
        write_fake_model(tmp_path, "later", "echo")
        (tmp_path / "broken").mkdir()
        await r.poll()
        assert r.get("echo").version == "2"
        assert r.get("later").version == "1"
        created = len(fakes.created)
        await r.poll()  # nothing changed: nothing reloads (the broken model is not retried either)
        assert len(fakes.created) == created
        (tmp_path / "echo" / "config.pbtxt").write_text(fake_config("echo", max_batch_size=4))
        await r.poll()
        assert r.get("echo").config.max_batch_size == 4
        import shutil

        shutil.rmtree(tmp_path / "later")
        await r.poll()
        with pytest.raises(ModelNotFoundError):
            r.get("later")
    finally:
        await r.close()


async def test_warmup_and_bytes_per_sample_from_the_config(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    extra = (
        f'parameters {{ key: "{PARAM_BYTES_PER_SAMPLE}" value {{ string_value: "1000" }} }}\n'
        'model_warmup [{ name: "w" batch_size: 3 count: 2 inputs { key: "INPUT0" value: '
        "{ data_type: TYPE_FP32 dims: [4] random_data: true } } }]"
    )
    write_fake_model(tmp_path, "echo", "echo", extra=extra)
    r = ModelRepository(tmp_path, runtimes=runtimes_with_fakes(fakes), threads=1, probe=lambda: 5500)
    await r.start()
    try:
        model = r.get("echo")
        assert fakes.created[0].batches == [3, 3]  # the warm-up ran before READY
        assert model.bytes_per_sample == 1000
        assert model.batcher.cap == 5  # floor(5500 / 1000) < max_batch_size 8
    finally:
        await r.close()


async def test_bytes_per_sample_from_the_toolchain_profile(tmp_path: Path, fakes: FakeRuntimeFactory) -> None:
    folder = write_fake_model(tmp_path, "echo", "echo")
    (folder / "1" / "profile.json").write_text('{"schema_version": 1, "bytes_per_sample": 2000}')
    r = ModelRepository(tmp_path, runtimes=runtimes_with_fakes(fakes), threads=1, probe=lambda: 7000)
    await r.start()
    try:
        assert r.get("echo").bytes_per_sample == 2000
        assert r.get("echo").batcher.cap == 3
    finally:
        await r.close()
