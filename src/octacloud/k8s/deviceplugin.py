"""kubelet's device plugin API (``v1beta1``) for octacloud's slices of a node's cards.

One plugin serves one resource over its own unix socket in kubelet's device plugin directory and registers it
with kubelet's ``Registration`` service (``kubelet.sock``):

- ``octacloud.io/octants``: eight devices per card, ``gpu3-octant5``; a pod asking for N octants gets N of them;
- ``octacloud.io/gpus``: one device per card, ``gpu3``.

``ListAndWatch`` streams the devices and their health (from NVML through :class:`~octacloud.observability.dcgm.
NvmlCards`: a card with uncorrected ECC errors or a critical XID is ``Unhealthy``, and so are its octants), and
again whenever health changes. ``GetPreferredAllocation`` keeps a container's octants on one card: the card the
scheduler extender chose for the pod kubelet is admitting, else the fullest card that fits. ``Allocate`` returns
the environment that binds the container to its slice — the same variables ``octacloud up`` gives a replica
(:func:`octacloud.control.slices.slice_environment`: MPS active-thread percentage and pinned-memory limit for a
share), with the cards made visible through the NVIDIA container runtime — and mounts the MPS pipe directory.

The plugin learns which pod it is allocating for from the API (the pods bound to its node whose placement
annotations name cards and that it has not yet allocated, oldest first), since kubelet's API says only which
devices; without an API it derives the card from the device IDs kubelet passed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from octacloud.control.slices import Slice, slice_environment
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Health, Node
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.k8s.api import ApiError, KubeClient, node_path, pod_path, pods_path
from octacloud.k8s.resources import (
    GPUS,
    OCTANTS,
    node_cards,
    pod_is_active,
    pod_key,
    pod_placement,
    requested_devices,
)
from octacloud.k8s.v1beta1 import api_pb2 as pb
from octacloud.observability.dcgm import ECC_DBE, XID, CardReading, NvmlCards

log = logging.getLogger("octacloud.k8s.deviceplugin")

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
MPS_PIPE_HOST_DIR = "/var/run/octacloud/mps"
MPS_PIPE_CONTAINER_DIR = "/var/run/octacloud/mps"
ALLOCATED_ANNOTATION = "octacloud.io/allocated"
"""Set by the plugin on a pod once kubelet allocated its devices (the value: the device IDs)."""

CRITICAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95})
"""XIDs after which a card should get no new work (double-bit ECC, row remapping, NVLink, fallen off the bus...)."""

_OCTANT_ID = re.compile(r"^gpu(\d+)-octant(\d+)$")
_GPU_ID = re.compile(r"^gpu(\d+)$")


def octant_id(card: int, octant: int) -> str:
    return f"gpu{card}-octant{octant}"


def card_of(device_id: str) -> int:
    """The card index of an octant (``gpu3-octant5``) or card (``gpu3``) device ID."""
    m = _OCTANT_ID.match(device_id) or _GPU_ID.match(device_id)
    if m is None:
        raise InvalidSpecError(f"device {device_id!r} is not one of octacloud's (gpuN or gpuN-octantK)")
    return int(m.group(1))


def card_health(reading: CardReading) -> Health:
    """FAILED after uncorrected ECC errors or a critical XID; else HEALTHY."""
    if reading.values.get(ECC_DBE, 0) > 0 or int(reading.values.get(XID, 0)) in CRITICAL_XIDS:
        return Health.FAILED
    return Health.HEALTHY


class HealthSource(Protocol):
    """Per-card health of this node, indexed by card. Must not block for long and never raise."""

    def health(self) -> list[Health]: ...


@dataclass(slots=True)
class NvmlHealth:
    """Card health from NVML readings (the project's NVML layer); a card that cannot be read is FAILED."""

    cards: NvmlCards
    clock: Callable[[], float]

    def health(self) -> list[Health]:
        try:
            readings = self.cards.read(self.clock())
        except Exception as exc:  # NVML itself failing: nothing on this node should get new work
            log.warning("NVML read failed (%s): every card reported unhealthy", exc)
            return [Health.FAILED] * len(self.cards.cards)
        return [card_health(r) for r in readings]


@dataclass(slots=True)
class StaticHealth:
    """The health a node description states (fleet files, CPU cards)."""

    node: Node

    def health(self) -> list[Health]:
        return [g.health for g in self.node.gpus]


def node_from_nvml(cards: NvmlCards, name: str, cpu_milli: int, memory_mib: int, now: float) -> Node:
    """This host's cards as an octacloud ``Node``, through the project's NVML reader."""
    readings = cards.read(now)
    gpus = []
    for r in readings:
        total = int(r.values.get("DCGM_FI_DEV_FB_USED", 0) + r.values.get("DCGM_FI_DEV_FB_FREE", 0))
        model = r.card.model.replace("NVIDIA ", "").replace(" ", "-")
        gpus.append(Gpu(r.card.index, model, total, None, card_health(r)))
    return Node(name, cpu_milli, memory_mib, tuple(gpus), labels={"octacloud.io/accelerator": "nvidia"})


@dataclass(slots=True)
class PendingPod:
    """A pod bound to this node that kubelet is about to start: where the extender placed it."""

    namespace: str
    name: str
    cards: tuple[int, ...]
    milli_per_gpu: int
    devices: int
    """How many devices of the plugin's resource its containers ask for."""


@dataclass
class DevicePlugin:
    """The ``DevicePlugin`` service for one resource (:data:`OCTANTS` or :data:`GPUS`) of one node."""

    node: Node
    resource: str
    health_source: HealthSource
    api: KubeClient | None = None
    mps_pipe_host_dir: str = MPS_PIPE_HOST_DIR
    card_ids: Sequence[str] = ()
    """What ``NVIDIA_VISIBLE_DEVICES`` names each card by (UUIDs when known; default: the host indices)."""
    _health: list[Health] = field(default_factory=list, init=False)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition, init=False)
    _stopping: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.resource not in (OCTANTS, GPUS):
            raise InvalidSpecError(f"resource must be {OCTANTS} or {GPUS}, got {self.resource!r}")
        self._health = [g.health for g in self.node.gpus]

    # ---- devices -----------------------------------------------------------------------------------------

    def device_ids(self, card: int) -> list[str]:
        if self.resource == GPUS:
            return [f"gpu{card}"]
        return [octant_id(card, k) for k in range(OCTANTS_PER_GPU)]

    def devices(self) -> list[pb.Device]:
        out: list[pb.Device] = []
        for g in self.node.gpus:
            health = HEALTHY if self._health[g.index] is Health.HEALTHY else UNHEALTHY
            out.extend(pb.Device(ID=d, health=health) for d in self.device_ids(g.index))
        return out

    async def refresh_health(self) -> bool:
        """Read health again; wake ``ListAndWatch`` streams when it changed. Returns whether it changed."""
        health = self.health_source.health()
        if health == self._health:
            return False
        log.info("%s: card health now %s", self.resource, [h.value for h in health])
        async with self._changed:
            self._health = health
            self._changed.notify_all()
        return True

    async def stop(self) -> None:
        async with self._changed:
            self._stopping = True
            self._changed.notify_all()

    @property
    def health(self) -> list[Health]:
        return list(self._health)

    # ---- the gRPC service ------------------------------------------------------------------------------

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen: list[Health] | None = None

        def news() -> bool:
            return self._stopping or self._health != seen

        while True:
            async with self._changed:
                await self._changed.wait_for(news)
                if self._stopping:
                    return
                seen = list(self._health)
                response = pb.ListAndWatchResponse(devices=self.devices())
            yield response

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        responses = []
        pending = await self._pending()
        for c in request.container_requests:
            try:
                available, must = list(c.available_deviceIDs), list(c.must_include_deviceIDs)
                ids = self.prefer(available, must, c.allocation_size, pending)
            except InvalidSpecError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        responses = []
        for c in request.container_requests:
            try:
                responses.append(await self.allocate(list(c.devices_ids)))
            except (InvalidSpecError, ApiError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    # ---- policy ------------------------------------------------------------------------------------------

    def prefer(
        self, available: list[str], must_include: list[str], size: int, pending: Sequence[PendingPod] = ()
    ) -> list[str]:
        """``size`` of ``available`` (``must_include`` first), on as few cards as possible: the pending pod's
        card(s) when a pod of that size waits, else the fullest card(s) that can hold them."""
        if size <= 0:
            return []
        by_card: dict[int, list[str]] = {}
        for d in sorted(set(available) | set(must_include), key=_device_order):
            by_card.setdefault(card_of(d), []).append(d)
        if len(available) + len(set(must_include) - set(available)) < size:
            raise InvalidSpecError(f"{size} devices asked for, only {len(available)} available")
        chosen: list[str] = list(dict.fromkeys(must_include))
        order: list[int] = []
        for p in pending:
            if p.devices == size:
                order = [g for g in p.cards if g in by_card]
                break
        must_cards = [card_of(d) for d in must_include]
        rest = sorted(
            (g for g in by_card if g not in order),
            key=lambda g: (g not in must_cards, len(by_card[g]) < min(size, OCTANTS_PER_GPU), len(by_card[g]), g),
        )
        for g in [*order, *rest]:
            for d in by_card[g]:
                if len(chosen) >= size:
                    break
                if d not in chosen:
                    chosen.append(d)
        return chosen[:size]

    async def allocate(self, device_ids: list[str]) -> pb.ContainerAllocateResponse:
        """The container's environment and mounts for ``device_ids`` (kubelet's choice of this resource)."""
        if not device_ids:
            raise InvalidSpecError("Allocate: no devices in the container request")
        for d in device_ids:
            g = card_of(d)
            if not 0 <= g < self.node.gpu_count:
                raise InvalidSpecError(f"device {d!r}: node {self.node.name} has no card {g}")
        pod = await self._claim(len(device_ids))
        if pod is not None:
            cards, milli = pod.cards, pod.milli_per_gpu
        else:
            cards, milli = self._slice_of(device_ids)
        s = Slice(self.node.name, cards, milli)
        env = slice_environment(self.node, s)
        mounts = []
        if env.get("CUDA_VISIBLE_DEVICES"):
            # The NVIDIA container runtime exposes only these cards, renumbered from 0 inside the container.
            names = [self.card_ids[g] if g < len(self.card_ids) else str(g) for g in cards]
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(names)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(k) for k in range(len(cards)))
            if milli < MILLI_PER_GPU:
                env["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_CONTAINER_DIR
                mounts.append(
                    pb.Mount(container_path=MPS_PIPE_CONTAINER_DIR, host_path=self.mps_pipe_host_dir, read_only=False)
                )
        annotations = {"octacloud.io/slice": str(s)}
        if pod is not None:
            annotations["octacloud.io/pod"] = f"{pod.namespace}/{pod.name}"
        return pb.ContainerAllocateResponse(envs=env, mounts=mounts, annotations=annotations)

    def _slice_of(self, device_ids: list[str]) -> tuple[tuple[int, ...], int]:
        cards = sorted({card_of(d) for d in device_ids})
        if self.resource == GPUS:
            return tuple(cards), MILLI_PER_GPU
        n = len(device_ids)
        if n >= OCTANTS_PER_GPU:
            if n % OCTANTS_PER_GPU:
                raise InvalidSpecError(f"{n} octants span more than one card; ask for at most 8 or a multiple of 8")
            return tuple(cards[: n // OCTANTS_PER_GPU]), MILLI_PER_GPU
        if len(cards) > 1:
            log.warning("octants %s span cards %s; the slice is on card %d", device_ids, cards, cards[0])
        return (cards[0],), n * MILLI_PER_OCTANT

    async def _pending(self) -> list[PendingPod]:
        """Pods bound to this node with a placement, not yet allocated, oldest first."""
        if self.api is None:
            return []
        try:
            pods = await self.api.list(pods_path(), field_selector=f"spec.nodeName={self.node.name}")
        except ApiError as exc:
            log.warning("cannot list this node's pods (%s): allocating from device IDs", exc)
            return []
        out: list[PendingPod] = []
        for obj in sorted(pods, key=lambda o: str((o.get("metadata") or {}).get("creationTimestamp", ""))):
            meta = obj.get("metadata") or {}
            if ALLOCATED_ANNOTATION in (meta.get("annotations") or {}) or not pod_is_active(obj):
                continue
            try:
                placement = pod_placement(obj)
                octants, gpus = requested_devices(obj, f"pod {pod_key(obj)}")
            except InvalidSpecError:
                continue
            if placement is None or placement.node != self.node.name:
                continue
            devices = octants if self.resource == OCTANTS else gpus
            if devices:
                out.append(
                    PendingPod(
                        str(meta.get("namespace") or "default"),
                        str(meta.get("name")),
                        placement.gpus,
                        placement.milli_per_gpu,
                        devices,
                    )
                )
        return out

    async def _claim(self, devices: int) -> PendingPod | None:
        """The oldest pending pod asking for ``devices`` devices, marked allocated on the API."""
        assert devices > 0
        for p in await self._pending():
            if p.devices != devices:
                continue
            if self.api is not None:
                patch = {"metadata": {"annotations": {ALLOCATED_ANNOTATION: self.resource}}}
                await self.api.patch(pod_path(p.namespace, p.name), patch)
            return p
        return None


def _device_order(device_id: str) -> tuple[int, int]:
    m = _OCTANT_ID.match(device_id)
    return (int(m.group(1)), int(m.group(2))) if m else (card_of(device_id), 0)


async def publish_node(api: KubeClient, node: Node, health: Sequence[Health]) -> None:
    """Label and annotate this node with its cards (what the scheduler extender reads)."""
    current = Node(
        node.name,
        node.cpu_milli,
        node.memory_mib,
        tuple(Gpu(g.index, g.model, g.memory_mib, g.nvlink_group, health[g.index]) for g in node.gpus),
    )
    cards = node_cards(current)
    await api.patch(node_path(node.name), {"metadata": {"labels": cards.labels(), "annotations": cards.annotations()}})
