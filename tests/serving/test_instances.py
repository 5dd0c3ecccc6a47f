"""Triton's instance-group rules on the GPUs a replica sees: ``count`` instances per GPU (every GPU of the slice,
or those ``gpus`` names), one runtime per card so that a replica on a two-card slice computes on both, the CUDA
provider opened on the instance's card, and a GPU the replica does not see refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving import DataPlane, InferenceRequest, ModelConfigError, ModelRepository, Tensor
from octacloud.serving.compute import ComputeProcess
from octacloud.serving.instances import PlacedRuntimes, instance_plan, load_runtime, place_config, places
from octacloud.serving.providers import CPU, CUDA, TENSORRT, choose_providers, visible_gpu_count
from octacloud.serving.repository.config import ModelConfig
from octacloud.serving.runtime import ModelRuntime
from octacloud.serving.testing import FakeRuntime, FakeRuntimeFactory, runtimes_with_fakes, write_fake_model

SLOW = 'parameters { key: "delay_ms" value { string_value: "300" } }\n'
APART = 'parameters { key: "batch_isolation" value { string_value: "requests" } }\n'
PROCESS = 'parameters { key: "compute" value { string_value: "process" } }\n'


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.mark.parametrize(
    ("groups", "gpus", "plan"),
    [
        ("", 0, (None,)),  # no instance_group: one instance, where the runtime decides
        ("", 2, (0, 1)),  # ... and on a GPU host one on each GPU, as Triton does
        ("instance_group [ { count: 3 kind: KIND_CPU } ]", 2, (None, None, None)),
        ("instance_group [ { count: 2 kind: KIND_GPU } ]", 2, (0, 0, 1, 1)),  # count per GPU
        ("instance_group [ { count: 2 kind: KIND_GPU } ]", 0, (None, None)),  # the runtime refuses or decides
        ("instance_group [ { count: 1 kind: KIND_GPU gpus: [1] } ]", 2, (1,)),
        ("instance_group [ { kind: KIND_GPU gpus: [1, 0] } ]", 4, (1, 0)),  # count 0 means 1
        ("instance_group [ { count: 2 kind: KIND_AUTO } ]", 1, (0, 0)),
        ("instance_group [ { kind: KIND_MODEL } ]", 2, (0, 1)),
        ("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", 2, (None, 0, 1)),
    ],
)
def test_the_plan_follows_triton_s_instance_group_rules(groups: str, gpus: int, plan: tuple[int | None, ...]) -> None:
    assert instance_plan(config(groups), gpus) == plan


@pytest.mark.parametrize(
    ("groups", "gpus", "named"),
    [
        (
            'instance_group [ { name: "b" kind: KIND_GPU gpus: [2] } ]',
            2,
            ["instance_group[0] ('b')", "GPU 2", "sees 2"],
        ),
        ("instance_group [ { kind: KIND_GPU gpus: [-1] } ]", 1, ["GPU -1", "sees 1"]),
        ("instance_group [ { kind: KIND_CPU }, { count: -2 } ]", 0, ["instance_group[1]", "count", "-2"]),
        ("instance_group [ { kind: KIND_CPU gpus: [0] } ]", 1, ["KIND_CPU", "gpus"]),
    ],
)
def test_a_group_that_cannot_be_placed_is_refused_by_name(groups: str, gpus: int, named: list[str]) -> None:
    with pytest.raises(ModelConfigError) as e:
        instance_plan(config(groups), gpus)
    assert all(word in str(e.value) for word in named), str(e.value)


def test_each_place_gets_its_own_group_and_the_cuda_provider_opens_on_its_card() -> None:
    base = config(
        'name: "m" instance_group [ { count: 2 kind: KIND_GPU } ]\n'
        'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }'
    )
    plan = instance_plan(base, 2)
    assert places(plan) == {0: 2, 1: 2}
    one = place_config(base, 1, 2)
    assert [(g.kind, g.count, list(g.gpus)) for g in one.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, 2, [1])]
    assert one.name == "m" and len(base.instance_group) == 1 and not base.instance_group[0].gpus  # a copy
    choice = choose_providers(one, [TENSORRT, CUDA, CPU], visible=True, memory_budget=1 << 30)
    assert choice.device == "cuda" and choice.device_id == 1
    options = dict(choice.providers)
    assert options[TENSORRT]["device_id"] == "1" and options[CUDA]["device_id"] == "1"
    assert options[CUDA]["gpu_mem_limit"] == str(1 << 30)  # the budget is per card
    assert choose_providers(place_config(base, 0, 2), [TENSORRT, CUDA, CPU], visible=True).device_id == 0
    cpu = choose_providers(place_config(base, None, 1), [CUDA, CPU], visible=True)
    assert cpu.names == [CPU] and cpu.device == "cpu"


def test_visible_gpus_are_counted_from_cuda_visible_devices() -> None:
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "3,5"}) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0  # a CPU slice
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": " "}) == 0


def request(model: str) -> InferenceRequest:
    return InferenceRequest(model, [Tensor.of("INPUT0", np.zeros((1, 4), np.float32))])


def device_of(answer: Any) -> int:
    values = {int(v) for v in answer.outputs[0].data.reshape(-1)}
    assert len(values) == 1
    return values.pop()


@pytest.mark.parametrize("compute", ["replica", "process"])
async def test_a_replica_on_two_cards_computes_on_both(tmp_path: Path, compute: str) -> None:
    """A plain ``KIND_GPU`` group on a replica that sees two GPUs: one instance per card, each warmed up, and two
    batches at once run one on each card; a CPU group beside it stays on the CPU."""
    extra = "instance_group [ { kind: KIND_GPU } ]\n" + SLOW + APART + (PROCESS if compute == "process" else "")
    write_fake_model(tmp_path, "gpu", "device", extra=extra)
    write_fake_model(tmp_path, "cpu", "device", extra="instance_group [ { kind: KIND_CPU } ]\n")
    fake = FakeRuntimeFactory(gpus=2)
    r = ModelRepository(tmp_path, runtimes=runtimes_with_fakes(fake), threads=4)
    await r.start()
    dp = DataPlane(r)
    try:
        model = r.get("gpu")
        runtime = model.runtime
        if compute == "replica":
            assert isinstance(runtime, PlacedRuntimes)
            placed = runtime.runtimes
            assert all(isinstance(f, FakeRuntime) for f in placed)
            assert [f.gpu for f in placed] == [0, 1]  # type: ignore[attr-defined]
            assert all(f.calls >= 1 for f in placed), "every card's runtime was warmed up"  # type: ignore[attr-defined]
        else:
            assert isinstance(runtime, ComputeProcess) and len(runtime.pids) == 2
        assert list(model.config.instance_group[0].gpus) == []  # the model's own config is served as it was
        answers = await asyncio.gather(dp.infer(request("gpu")), dp.infer(request("gpu")))
        assert sorted(device_of(a) for a in answers) == [0, 1]
        assert device_of(await dp.infer(request("cpu"))) == -1
    finally:
        await r.close()


async def test_a_group_naming_a_card_the_replica_lacks_fails_that_model_only(tmp_path: Path) -> None:
    write_fake_model(tmp_path, "third", "device", extra="instance_group [ { kind: KIND_GPU gpus: [2] } ]\n")
    write_fake_model(tmp_path, "second", "device", extra="instance_group [ { kind: KIND_GPU gpus: [1] } ]\n")
    r = ModelRepository(tmp_path, runtimes=runtimes_with_fakes(FakeRuntimeFactory(gpus=2)), threads=1)
    await r.start()
    dp = DataPlane(r)
    try:
        entries = {e.name: e for e in r.index()}
        assert entries["third"].state == "UNAVAILABLE"
        assert "names GPU 2, but this replica sees 2 GPU(s)" in entries["third"].reason
        assert device_of(await dp.infer(request("second"))) == 1
    finally:
        await r.close()


class FailsOnSecondCard(FakeRuntimeFactory):
    def __call__(self, version_dir: Path, config: ModelConfig, threads: int) -> ModelRuntime:
        if list(config.instance_group[0].gpus) == [1]:
            raise ModelConfigError("card 1 is broken")
        return super().__call__(version_dir, config, threads)


def test_a_card_that_cannot_load_frees_the_cards_already_loaded(tmp_path: Path) -> None:
    write_fake_model(tmp_path, "m", "echo", extra="instance_group [ { kind: KIND_GPU } ]\n")
    base = text_format.Parse((tmp_path / "m" / "config.pbtxt").read_text(), mc.ModelConfig())
    fake = FailsOnSecondCard(gpus=2)
    with pytest.raises(ModelConfigError, match="card 1 is broken"):
        load_runtime(fake, tmp_path / "m" / "1", base, 2, instance_plan(base, 2), 2)
    assert len(fake.created) == 1 and fake.created[0].closed and fake.created[0].gpu == 0
