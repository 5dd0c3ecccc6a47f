"""A replica's slice of the fleet, and the process environment that binds it there.

On NVIDIA GPUs a slice of one card is enforced with CUDA MPS: the replica sees only its card
(``CUDA_VISIBLE_DEVICES``), may use ``octants / 8`` of its SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and at
most its share of the card's memory, never more than 80 % of it (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``).
Whole cards need no MPS limits. On a CPU "card" (machines without GPUs) the slice is a thread budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core.model import Node
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, max_model_memory_mib
from octacloud.serving.memory import MEMORY_ENV

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Slice:
    node: str
    gpus: tuple[int, ...]
    milli_per_gpu: int

    @property
    def octants(self) -> int:
        return len(self.gpus) * self.milli_per_gpu // MILLI_PER_OCTANT

    def __str__(self) -> str:
        cards = ",".join(map(str, self.gpus))
        return f"{self.node}/gpu{cards}@{self.milli_per_gpu}m"


def thread_budget(node: Node, s: Slice) -> int:
    """onnxruntime intra-op threads for a slice: its share of the node's cores (at least one)."""
    cores = max(1, node.cpu_milli // 1000)
    cards = max(1, node.gpu_count)
    share = cores * s.milli_per_gpu * max(1, len(s.gpus)) // (cards * MILLI_PER_GPU)
    return max(1, share)


def memory_budget_mib(node: Node, s: Slice) -> int:
    """The memory a replica on slice ``s`` may use on each of its cards: its share of the card, and never more
    than the 80 % of a card a single model may take."""
    if not s.gpus:
        return 0
    card = node.gpus[s.gpus[0]].memory_mib
    return min(card * s.milli_per_gpu // MILLI_PER_GPU, max_model_memory_mib(card))


def slice_environment(node: Node, s: Slice) -> dict[str, str]:
    """Environment variables that confine a replica process to slice ``s`` of ``node``.

    Every replica gets its memory budget (``OCTACLOUD_MEMORY_BYTES``, per card): the batcher caps batches by it
    and, on a GPU, onnxruntime's CUDA arena is limited to it, so the budget holds with or without MPS."""
    env = {
        "OCTACLOUD_SLICE": str(s),
        "OCTACLOUD_OCTANTS": str(s.octants),
    }
    budget = memory_budget_mib(node, s)
    if budget:
        env[MEMORY_ENV] = str(budget * _MIB)
    threads = thread_budget(node, s)
    env["OCTACLOUD_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    if not s.gpus or node.gpus[s.gpus[0]].model == CPU_CARD_MODEL:
        env["CUDA_VISIBLE_DEVICES"] = ""  # compute on the CPU; never touch a GPU by accident
        return env
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in s.gpus)
    if s.milli_per_gpu < MILLI_PER_GPU:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, s.milli_per_gpu * 100 // MILLI_PER_GPU))
        # Device ordinals inside the process are renumbered from 0 by CUDA_VISIBLE_DEVICES.
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={budget}M"
    return env
