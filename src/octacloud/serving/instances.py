"""Where a model's instances run: Triton's ``instance_group`` rules, applied to the GPUs a replica sees.

Triton's rules ("Instance Groups" in its model configuration guide):

- a ``KIND_GPU`` group puts ``count`` instances on *each* GPU it names in ``gpus``, or on each GPU the server
  sees when it names none;
- a ``KIND_CPU`` group puts ``count`` instances on the CPU;
- ``KIND_AUTO`` (and a config without ``instance_group``, which is one ``KIND_AUTO`` group) is ``KIND_GPU``
  where a GPU is visible, else ``KIND_CPU``; ``KIND_MODEL`` (placement left to the backend, which for
  onnxruntime means the same) is taken as ``KIND_AUTO``;
- a ``count`` of 0 means 1.

A replica sees the cards of its slice, numbered from 0 by ``CUDA_VISIBLE_DEVICES``: a replica on a two-card
slice has GPUs 0 and 1, and a plain ``instance_group [ { kind: KIND_GPU } ]`` puts one instance on each, so that
both cards compute. A group that names a GPU the replica does not see is a config error that names it.

Where a replica can compute on no GPU (``gpus == 0``) each group gives ``count`` instances in one place and the
runtime decides whether the model may run there: a ``KIND_GPU`` model is refused with the reason
(``providers.py``), never silently moved to the CPU.

Each *place* (one GPU, or the CPU) gets its own runtime, loaded with :func:`place_config`: the model's config
with its instance groups replaced by the one group of that place, so that the runtime opens its session on that
device (``providers.py`` reads the device from the group's ``gpus``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.providers import GPU_KINDS
from octacloud.serving.runtime import Arrays, ModelRuntime, RuntimeFactory
from octacloud.serving.types import TensorMetadata

Place = int | None
"""A GPU, numbered as the replica sees them, or None: the CPU (or, where no GPU is visible, wherever the
runtime decides)."""


def instance_plan(config: mc.ModelConfig, gpus: int) -> tuple[Place, ...]:
    """One place per model instance, in the config's group order; ``gpus``: how many GPUs this replica may
    compute on (0: none). Raises :class:`ModelConfigError` for a negative count or a GPU the replica does not
    see."""
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_AUTO)]
    plan: list[Place] = []
    for i, group in enumerate(groups):
        label = f"instance_group[{i}]" + (f" ({group.name!r})" if group.name else "")
        if group.count < 0:
            raise ModelConfigError(f"{label}: count must be > 0, got {group.count}")
        count = group.count or 1
        if gpus == 0 or group.kind not in GPU_KINDS:
            if group.gpus and group.kind == mc.ModelInstanceGroup.KIND_CPU:
                raise ModelConfigError(f"{label}: a KIND_CPU group cannot name gpus {list(group.gpus)}")
            plan += [None] * count
            continue
        devices = list(group.gpus) if group.gpus else list(range(gpus))
        unseen = [d for d in devices if not 0 <= d < gpus]
        if unseen:
            raise ModelConfigError(
                f"{label} names GPU {unseen[0]}, but this replica sees {gpus} GPU(s), numbered 0 to {gpus - 1} "
                "(its slice's cards, renumbered by CUDA_VISIBLE_DEVICES)"
            )
        for device in devices:
            plan += [device] * count
    return tuple(plan)


def places(plan: Sequence[Place]) -> dict[Place, int]:
    """Each distinct place of ``plan`` (in first-seen order) with how many instances it holds."""
    counts: dict[Place, int] = {}
    for place in plan:
        counts[place] = counts.get(place, 0) + 1
    return counts


def place_config(config: mc.ModelConfig, place: Place, count: int) -> mc.ModelConfig:
    """A copy of ``config`` whose instance groups are the one group of ``place``: ``count`` instances on GPU
    ``place``, or on the CPU."""
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    del copy.instance_group[:]
    if place is None:
        copy.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=count)
    else:
        copy.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=count, gpus=[place])
    return copy


def factory_gpus(factory: RuntimeFactory) -> int:
    """How many GPUs models loaded by ``factory`` may compute on: its ``gpus()`` where it has one (the ONNX
    factory: 0 without onnxruntime's CUDA provider or on a CPU slice), else 0."""
    gpus = getattr(factory, "gpus", None)
    return int(gpus()) if callable(gpus) else 0


def place_configs(config: mc.ModelConfig, plan: Sequence[Place], gpus: int) -> list[mc.ModelConfig]:
    """The config each instance of ``plan`` loads with (a compute process per instance): the model's own where
    no GPU is visible, else its place's (:func:`place_config`, one instance each)."""
    if gpus == 0:
        return [config] * len(plan)
    return [place_config(config, place, 1) for place in plan]


def load_runtime(
    factory: RuntimeFactory, version_dir: Path, config: mc.ModelConfig, threads: int, plan: Sequence[Place], gpus: int
) -> ModelRuntime:
    """The runtime of a model computed in the replica: the factory's own where no GPU is visible (the config as
    it is), one runtime on the one place of ``plan``, else :class:`PlacedRuntimes` over one runtime per place,
    the thread budget split among them. Blocking: call it from a worker thread."""
    if gpus == 0:
        return factory(version_dir, config, threads)
    where = places(plan)
    if len(where) == 1:
        ((place, count),) = where.items()
        return factory(version_dir, place_config(config, place, count), threads)
    share = max(1, threads // len(where))
    loaded: list[tuple[ModelRuntime, int]] = []
    try:
        for place, count in where.items():
            loaded.append((factory(version_dir, place_config(config, place, count), share), count))
    except BaseException:
        for runtime, _ in loaded:
            runtime.close()
        raise
    return PlacedRuntimes(loaded)


class PlacedRuntimes:
    """A model whose instances are in several places (several GPUs, or GPUs and the CPU): one runtime per
    place. A batch runs on the place with the fewest batches in hand for its instances, the one that has run
    fewer batches on a tie, so that an idle replica spreads its batches over its cards too."""

    def __init__(self, runtimes: Sequence[tuple[ModelRuntime, int]]) -> None:
        if not runtimes:
            raise ValueError("PlacedRuntimes needs at least one runtime")
        self.runtimes = [runtime for runtime, _ in runtimes]
        self._slots = [max(1, count) for _, count in runtimes]
        self._in_hand = [0] * len(runtimes)
        self._ran = [0] * len(runtimes)
        self._lock = threading.Lock()
        self.couples_rows: bool = any(getattr(r, "couples_rows", False) for r in self.runtimes)

    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self.runtimes[0].inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return self.runtimes[0].outputs

    @property
    def device(self) -> str:
        return self.runtimes[0].device

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        with self._lock:
            i = min(range(len(self.runtimes)), key=lambda k: (self._in_hand[k] / self._slots[k], self._ran[k]))
            self._in_hand[i] += 1
            self._ran[i] += 1
        try:
            return self.runtimes[i].run(inputs, outputs)
        finally:
            with self._lock:
                self._in_hand[i] -= 1

    def warm(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        """One batch on every place (the warm-up's path); the first place's answer."""
        answers = [runtime.run(inputs, outputs) for runtime in self.runtimes]
        return answers[0]

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()
