"""The domain model validates what a user can get wrong, with messages naming the field and value."""

from __future__ import annotations

import pytest

from octacloud.core import Gpu, InvalidSpecError, ManualClock, Node, Request
from octacloud.core.units import max_model_memory_mib, milli_to_octants, octants_to_milli, round_up_to_octant


def test_octant_arithmetic() -> None:
    assert octants_to_milli(8) == 1000
    assert milli_to_octants(1) == 1
    assert milli_to_octants(125) == 1
    assert milli_to_octants(126) == 2
    assert round_up_to_octant(470) == 500
    assert max_model_memory_mib(16384) == 13107
    with pytest.raises(ValueError, match="octants must be >= 0"):
        octants_to_milli(-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_gpu": 2, "gpu_milli": 500}, "must take whole cards"),
        ({"num_gpu": 1, "gpu_milli": 1001}, "gpu_milli must be 0..1000"),
        ({"num_gpu": 1, "gpu_milli": 0}, "must both be 0 or both > 0"),
        ({"num_gpu": 0, "gpu_milli": 0, "cpu_milli": -1}, "cpu_milli must be >= 0, got -1"),
        ({"num_gpu": 17, "gpu_milli": 1000}, "num_gpu must be 0..16"),
    ],
)
def test_bad_requests_name_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        Request(name="r", **kwargs)


def test_request_properties() -> None:
    share = Request(name="s", num_gpu=1, gpu_milli=470, gpu_models=frozenset({"T4"}))
    assert share.is_sharing and share.total_gpu_milli == 470
    assert share.allows_model("T4") and not share.allows_model("V100M16")
    multi = Request(name="m", num_gpu=4, gpu_milli=1000)
    assert not multi.is_sharing and multi.total_gpu_milli == 4000 and multi.allows_model("A10")


def test_node_validation() -> None:
    gpus = tuple(Gpu(index=i, model="A10", memory_mib=24576) for i in range(2))
    node = Node(name="n0", cpu_milli=64000, memory_mib=262144, gpus=gpus, labels={"zone": "a"})
    assert node.gpu_count == 2 and node.gpu_model == "A10" and node.gpu_milli == 2000
    with pytest.raises(TypeError):
        node.labels["zone"] = "b"  # type: ignore[index]
    with pytest.raises(InvalidSpecError, match="GPU indices must be 0..1 in order"):
        Node(name="n1", cpu_milli=1, memory_mib=1, gpus=(gpus[1], gpus[0]))
    with pytest.raises(InvalidSpecError, match="node name must not be empty"):
        Node(name="", cpu_milli=1, memory_mib=1)


def test_manual_clock_only_moves_forward() -> None:
    clock = ManualClock()
    clock.advance(1.5)
    assert clock.monotonic() == 1.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)
