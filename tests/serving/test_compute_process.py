"""A model computed in a child process (``compute: "process"``): same answers as in the replica, errors of
the model and of a bad config named, a child killed with -9 mid-batch costs that batch only, the child stops
with its model and with its replica."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from octacloud.serving import (
    DataPlane,
    InferenceRequest,
    ModelExecutionError,
    ModelRepository,
    Tensor,
)
from octacloud.serving.compute import ComputeProcess
from octacloud.serving.testing import (
    FakeRuntimeFactory,
    add_onnx,
    runtimes_with_fakes,
    write_fake_model,
    write_onnx_model,
)

PROCESS = 'parameters { key: "compute" value { string_value: "process" } }\n'
ADD = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [4] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] } ]
"""


def repository(root: Path) -> ModelRepository:
    return ModelRepository(root, runtimes=runtimes_with_fakes(FakeRuntimeFactory()), threads=1)


def add_request(model: str, a: float, rows: int = 1) -> InferenceRequest:
    x = np.full((rows, 4), a, np.float32)
    return InferenceRequest(model, [Tensor.of("INPUT0", x), Tensor.of("INPUT1", x + 1)])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


async def test_a_model_in_its_own_process_answers_as_in_the_replica(tmp_path: Path) -> None:
    write_onnx_model(tmp_path, "inline", add_onnx(), ADD)
    write_onnx_model(tmp_path, "child", add_onnx(), ADD + PROCESS)
    r = repository(tmp_path)
    await r.start()
    dp = DataPlane(r)
    try:
        child = r.get("child").runtime
        assert isinstance(child, ComputeProcess) and child.pid != os.getpid() and alive(child.pid)
        assert not isinstance(r.get("inline").runtime, ComputeProcess)
        assert r.get("child").config.max_batch_size == 8 and [i.name for i in r.get("child").config.input] == [
            "INPUT0",
            "INPUT1",
        ]
        assert r.get("child").bytes_per_sample >= 3 * 4 * 4  # measured in the child at warm-up
        requests = [add_request(m, float(i), rows=1 + i % 3) for i in range(12) for m in ("inline", "child")]
        answers = await asyncio.gather(*(dp.infer(q) for q in requests))
        for q, a in zip(requests, answers, strict=True):
            expected = q.inputs[0].data + q.inputs[1].data
            np.testing.assert_array_equal(a.outputs[0].data, expected)
        assert r.get("child").stats.execution_count < 12  # the child's batches were batched as well
    finally:
        await r.close()
    assert wait_gone(child.pid), "unloading the model stops its compute process"


async def test_a_failing_batch_fails_alone_and_the_child_goes_on(tmp_path: Path) -> None:
    write_fake_model(tmp_path, "err", "error", extra=PROCESS)
    r = repository(tmp_path)
    await r.start()
    dp = DataPlane(r)
    try:
        pid = r.get("err").runtime.pid  # type: ignore[attr-defined]
        ones = InferenceRequest("err", [Tensor.of("INPUT0", np.ones((1, 4), np.float32))])
        with pytest.raises(ModelExecutionError, match="failed on purpose"):
            await dp.infer(ones)
        zeros = InferenceRequest("err", [Tensor.of("INPUT0", np.zeros((1, 4), np.float32))])
        assert (await dp.infer(zeros)).outputs[0].data.tolist() == [[0.0] * 4]
        assert r.get("err").runtime.pid == pid  # type: ignore[attr-defined]
    finally:
        await r.close()


async def test_a_bad_model_or_parameter_is_a_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    (tmp_path / "broken" / "config.pbtxt").write_text('backend: "onnxruntime"\n' + PROCESS)
    write_fake_model(tmp_path, "typo", "echo", extra='parameters { key: "compute" value { string_value: "proces" } }')
    write_fake_model(tmp_path, "fine", "echo", extra=PROCESS)
    r = repository(tmp_path)
    await r.start()
    try:
        errors = {e.name: e.reason for e in r.index() if e.state != "READY"}
        assert "onnxruntime cannot load it" in errors["broken"]
        assert "'compute' is 'proces'" in errors["typo"] and "process" in errors["typo"]
        assert r.get("fine").state.value == "READY"  # the others load
    finally:
        await r.close()


async def test_kill_9_of_the_child_mid_batch_fails_that_batch_and_the_next_runs_on_a_new_child(
    tmp_path: Path,
) -> None:
    write_fake_model(
        tmp_path, "slow", "slow", extra=PROCESS + 'parameters { key: "delay_ms" value { string_value: "400" } }'
    )
    r = repository(tmp_path)
    await r.start()
    dp = DataPlane(r)
    try:
        model = r.get("slow")
        runtime = model.runtime
        assert isinstance(runtime, ComputeProcess)
        first = runtime.pid
        x = InferenceRequest("slow", [Tensor.of("INPUT0", np.full((1, 4), 3, np.float32))])
        await dp.infer(x)  # the loop owns the socket now
        inflight = asyncio.ensure_future(dp.infer(x))
        await asyncio.sleep(0.15)  # the child is computing the batch
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ModelExecutionError, match="stopped during the batch"):
            await inflight
        again = await asyncio.gather(*(dp.infer(x) for _ in range(3)))  # one restart serves them all
        assert [a.outputs[0].data.tolist() for a in again] == [[[3.0] * 4]] * 3
        assert runtime.pid != first and alive(runtime.pid) and runtime.restarts == 1
        assert model.state.value == "READY"
    finally:
        await r.close()


def test_the_child_exits_when_its_replica_is_killed(tmp_path: Path) -> None:
    """kill -9 of the replica: the kernel closes its socket and the child, blocked reading it, exits."""
    write_onnx_model(tmp_path, "child", add_onnx(), ADD + PROCESS)
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from octacloud.serving import ModelRepository
        async def main():
            r = ModelRepository(Path({str(tmp_path)!r}), threads=1)
            await r.start()
            print(r.get("child").runtime.pid, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    replica = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert replica.stdout is not None
        child = int(replica.stdout.readline())
        assert alive(child)
        replica.kill()
        replica.wait()
        assert wait_gone(child), "the compute process outlived its replica"
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait()
        if replica.stdout is not None:
            replica.stdout.close()


def test_the_replica_s_uvloop_carries_the_child_s_answers(tmp_path: Path) -> None:
    """Replicas run on uvloop, whose transports are not asyncio's classes."""
    import uvloop

    write_onnx_model(tmp_path, "child", add_onnx(), ADD + PROCESS)

    async def go() -> list[float]:
        r = repository(tmp_path)
        await r.start()
        try:
            answer = await DataPlane(r).infer(add_request("child", 2.0))
            return [float(v) for v in answer.outputs[0].data.reshape(-1)]
        finally:
            await r.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(go()) == [5.0] * 4


TWO_INSTANCES = (
    PROCESS
    + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    + 'parameters { key: "batch_isolation" value { string_value: "requests" } }\n'
    + 'parameters { key: "delay_ms" value { string_value: "300" } }\n'
)


def pid_request(model: str = "two") -> InferenceRequest:
    return InferenceRequest(model, [Tensor.of("INPUT0", np.zeros((1, 4), np.float32))])


def pid_of(answer: object) -> int:
    values = {int(v) for v in answer.outputs[0].data.reshape(-1)}  # type: ignore[attr-defined]
    assert len(values) == 1
    return values.pop()


async def test_each_instance_computes_in_a_child_of_its_own(tmp_path: Path) -> None:
    """``instance_group { count: 2 }``: two children, and two batches at once compute one in each (the second
    batch goes to the child with nothing in hand, not behind the first)."""
    write_fake_model(tmp_path, "two", "pid", extra=TWO_INSTANCES)
    write_fake_model(tmp_path, "one", "pid", extra=PROCESS)
    r = repository(tmp_path)
    await r.start()
    dp = DataPlane(r)
    try:
        runtime = r.get("two").runtime
        assert isinstance(runtime, ComputeProcess)
        pids = runtime.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids and all(alive(p) for p in pids)
        assert len(r.get("one").runtime.pids) == 1  # type: ignore[attr-defined]
        answers = await asyncio.gather(dp.infer(pid_request()), dp.infer(pid_request()))
        assert sorted(pid_of(a) for a in answers) == sorted(pids)
        assert r.get("two").stats.execution_count >= 2
    finally:
        await r.close()
    assert all(wait_gone(p) for p in pids), "unloading the model stops every compute process"


async def test_kill_9_of_one_instance_s_child_spares_the_other_instance(tmp_path: Path) -> None:
    write_fake_model(tmp_path, "two", "pid", extra=TWO_INSTANCES)
    r = repository(tmp_path)
    await r.start()
    dp = DataPlane(r)
    try:
        runtime = r.get("two").runtime
        assert isinstance(runtime, ComputeProcess)
        first, second = runtime.pids
        await asyncio.gather(dp.infer(pid_request()), dp.infer(pid_request()))  # the loop owns both sockets
        both = [asyncio.ensure_future(dp.infer(pid_request())) for _ in range(2)]
        for _ in range(500):  # until each child has its batch (300 ms of compute each)
            if [c.in_hand for c in runtime._children] == [1, 1]:
                break
            await asyncio.sleep(0.01)
        assert [c.in_hand for c in runtime._children] == [1, 1]
        os.kill(first, signal.SIGKILL)
        done = await asyncio.gather(*both, return_exceptions=True)
        failed = [d for d in done if isinstance(d, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], ModelExecutionError)
        assert "stopped during the batch" in str(failed[0])
        assert [pid_of(d) for d in done if not isinstance(d, BaseException)] == [second]
        again = await asyncio.gather(*(dp.infer(pid_request()) for _ in range(4)))
        served = {pid_of(a) for a in again}
        assert second in served and first not in served
        assert runtime.restarts == 1 and runtime.pids[1] == second and alive(runtime.pids[0])
        assert r.get("two").state.value == "READY"
    finally:
        await r.close()


def children() -> set[int]:
    """This process's child processes, zombies included (listed until reaped), from every thread."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


async def test_a_model_no_instance_can_load_is_named_and_leaves_no_process(tmp_path: Path) -> None:
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\ninstance_group [ { count: 3 kind: KIND_CPU } ]\n' + PROCESS
    )
    before = children()
    r = repository(tmp_path)
    await r.start()
    try:
        errors = {e.name: e.reason for e in r.index() if e.state != "READY"}
        assert "onnxruntime cannot load it" in errors["broken"]
        assert not children() - before, "a compute process outlived the failed load, or was never reaped"
    finally:
        await r.close()
