"""A slice becomes the environment that confines a replica: MPS on GPUs, a thread budget on the CPU."""

from __future__ import annotations

from octacloud.control.fleet import CPU_CARD_MODEL, cpu_host_node
from octacloud.control.slices import Slice, slice_environment, thread_budget
from octacloud.core import Gpu, Node


def _node(model: str, cards: int = 8, cores: int = 64) -> Node:
    return Node("n", cores * 1000, 512 * 1024, tuple(Gpu(i, model, 16384) for i in range(cards)))


def test_shared_card_uses_mps_limits() -> None:
    env = slice_environment(_node("T4"), Slice("n", (3,), 250))
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env["OCTACLOUD_OCTANTS"] == "2"


def test_memory_limit_never_exceeds_80_percent() -> None:
    env = slice_environment(_node("T4"), Slice("n", (0,), 875))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={16384 * 80 // 100}M"


def test_whole_cards_have_no_mps_limits() -> None:
    env = slice_environment(_node("A100"), Slice("n", (2, 3), 1000))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_cpu_cards_get_a_thread_budget() -> None:
    node = _node(CPU_CARD_MODEL, cards=1, cores=16)
    env = slice_environment(node, Slice("n", (0,), 500))
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["OCTACLOUD_THREADS"] == "8"
    assert thread_budget(_node(CPU_CARD_MODEL, cards=1, cores=2), Slice("n", (0,), 125)) == 1


def test_every_slice_carries_its_memory_budget() -> None:
    """The launcher's env gives the replica its memory budget (read by serving/memory.py and the CUDA arena)."""
    env = slice_environment(_node("T4"), Slice("n", (3,), 250))
    assert env["OCTACLOUD_MEMORY_BYTES"] == str(4096 * 1024 * 1024)
    whole = slice_environment(_node("T4"), Slice("n", (1,), 1000))
    assert whole["OCTACLOUD_MEMORY_BYTES"] == str(16384 * 80 // 100 * 1024 * 1024)  # the 80 % rule
    node = cpu_host_node("h", cards=2)
    cpu = slice_environment(node, Slice("h", (0,), 500))
    assert int(cpu["OCTACLOUD_MEMORY_BYTES"]) == node.gpus[0].memory_mib * 500 // 1000 * 1024 * 1024
