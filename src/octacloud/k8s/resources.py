"""The wire vocabulary between octacloud and Kubernetes, and conversions between their objects.

Pods ask for octacloud capacity as extended resources::

    resources:
      limits:
        octacloud.io/octants: 4     # a share of one card: 1..8 octants (8 octants = one whole card)
        # or octacloud.io/gpus: 2   # whole cards

Extended resources are counts that Kubernetes keeps as ``limits`` (a ``requests`` entry, if given, must equal
it). Annotations and labels a pod may carry: ``octacloud.io/gpu-memory-mib`` (memory its model needs per card),
``octacloud.io/gpu-models`` (comma-separated card models allowed), label ``octacloud.io/tenant`` (owner).

The scheduler extender records its choice on the pod when it binds it (``octacloud.io/node``,
``octacloud.io/cards`` like ``"3"`` or ``"0,1"``, ``octacloud.io/milli-per-card``); the device plugin reads it back
when kubelet allocates the pod's devices, and the extender rebuilds its state from it after a restart.

Nodes describe their cards with labels the device plugin sets (``octacloud.io/gpu-count``,
``octacloud.io/gpu-model``, ``octacloud.io/gpu-memory-mib``) and annotations for what changes
(``octacloud.io/nvlink-groups`` like ``"0,0,1,1"`` with ``-`` for a PCIe-only card, and
``octacloud.io/unhealthy-cards`` like ``"2"``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Health, Node, Placement, Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU

GROUP = "octacloud.io"
OCTANTS = "octacloud.io/octants"
GPUS = "octacloud.io/gpus"
RESOURCES = (OCTANTS, GPUS)

TENANT_LABEL = "octacloud.io/tenant"
GPU_MEMORY = "octacloud.io/gpu-memory-mib"
GPU_MODELS = "octacloud.io/gpu-models"

NODE_ANNOTATION = "octacloud.io/node"
CARDS_ANNOTATION = "octacloud.io/cards"
MILLI_ANNOTATION = "octacloud.io/milli-per-card"
PLACEMENT_ANNOTATIONS = (NODE_ANNOTATION, CARDS_ANNOTATION, MILLI_ANNOTATION)

GPU_COUNT_LABEL = "octacloud.io/gpu-count"
GPU_MODEL_LABEL = "octacloud.io/gpu-model"
GPU_MEMORY_LABEL = "octacloud.io/gpu-memory-mib"
NVLINK_ANNOTATION = "octacloud.io/nvlink-groups"
UNHEALTHY_ANNOTATION = "octacloud.io/unhealthy-cards"

Obj = dict[str, Any]
"""A Kubernetes object as decoded JSON."""

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIX: Mapping[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def parse_quantity(value: object, where: str) -> Fraction:
    """A Kubernetes ``resource.Quantity`` (``"500m"``, ``"16Gi"``, ``"1e3"``, ``4``) as an exact fraction."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidSpecError(f"{where}: expected a quantity like '4', '500m' or '16Gi', got {value!r}")
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if m is None:
        raise InvalidSpecError(f"{where}: {text!r} is not a Kubernetes quantity (like '4', '500m' or '16Gi')")
    number, suffix = m.group(1), m.group(2) or ""
    try:
        base = Fraction(number)
    except ValueError:
        raise InvalidSpecError(f"{where}: {text!r} is not a Kubernetes quantity") from None
    if suffix[:1] in ("e", "E"):
        return base * Fraction(10) ** int(suffix[1:])
    return base * _SUFFIX[suffix]


def _count(value: object, where: str) -> int:
    q = parse_quantity(value, where)
    if q.denominator != 1 or q < 0:
        raise InvalidSpecError(f"{where}: expected a whole number of devices, got {value!r}")
    return int(q)


def _mapping(obj: object, where: str) -> Mapping[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise InvalidSpecError(f"{where}: expected an object, got {type(obj).__name__}")
    return obj


def metadata(obj: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    return _mapping(obj.get("metadata"), f"{where}.metadata")


def pod_key(pod: Mapping[str, Any]) -> str:
    """``namespace/name`` of a pod (for messages)."""
    meta = metadata(pod, "pod")
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def pod_uid(pod: Mapping[str, Any]) -> str:
    """The pod's UID, the key octacloud knows it by (``namespace/name`` when a fixture has none)."""
    meta = metadata(pod, "pod")
    uid = meta.get("uid")
    return str(uid) if uid else pod_key(pod)


def requested_devices(pod: Mapping[str, Any], where: str = "pod") -> tuple[int, int]:
    """(octants, whole cards) the pod's containers ask for in total."""
    spec = _mapping(pod.get("spec"), f"{where}.spec")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise InvalidSpecError(f"{where}.spec.containers: a pod needs a non-empty list of containers")
    totals = {OCTANTS: 0, GPUS: 0}
    for k, c in enumerate(containers):
        cw = f"{where}.spec.containers[{k}]"
        resources = _mapping(_mapping(c, cw).get("resources"), f"{cw}.resources")
        limits = _mapping(resources.get("limits"), f"{cw}.resources.limits")
        requests = _mapping(resources.get("requests"), f"{cw}.resources.requests")
        for name in RESOURCES:
            limit = _count(limits[name], f"{cw}.resources.limits[{name}]") if name in limits else None
            request = _count(requests[name], f"{cw}.resources.requests[{name}]") if name in requests else None
            if limit is not None and request is not None and limit != request:
                raise InvalidSpecError(
                    f"{cw}: {name} requests ({request}) and limits ({limit}) must be equal for a device resource"
                )
            totals[name] += limit if limit is not None else (request or 0)
    return totals[OCTANTS], totals[GPUS]


def pod_request(pod: Mapping[str, Any]) -> Request | None:
    """The octacloud request of a pod, or None when it asks for no octacloud capacity."""
    where = f"pod {pod_key(pod)}"
    octants, gpus = requested_devices(pod, where)
    if not octants and not gpus:
        return None
    if octants and gpus:
        raise InvalidSpecError(f"{where}: ask for either {OCTANTS} or {GPUS}, not both")
    if octants > OCTANTS_PER_GPU and octants % OCTANTS_PER_GPU:
        raise InvalidSpecError(
            f"{where}: {OCTANTS}: {octants} spans more than one card; ask for at most {OCTANTS_PER_GPU} octants "
            f"or a multiple of {OCTANTS_PER_GPU} (whole cards)"
        )
    if octants:
        whole = octants >= OCTANTS_PER_GPU
        num_gpu = octants // OCTANTS_PER_GPU if whole else 1
        milli = MILLI_PER_GPU if whole else octants * MILLI_PER_OCTANT
    else:
        num_gpu, milli = gpus, MILLI_PER_GPU
    if num_gpu > 16:
        raise InvalidSpecError(f"{where}: asks for {num_gpu} cards; a node has at most 16")
    meta = metadata(pod, where)
    annotations = _mapping(meta.get("annotations"), f"{where}.metadata.annotations")
    labels = _mapping(meta.get("labels"), f"{where}.metadata.labels")
    memory = 0
    if GPU_MEMORY in annotations:
        memory = _count(annotations[GPU_MEMORY], f"{where}: annotation {GPU_MEMORY}")
    models = frozenset(m.strip() for m in str(annotations.get(GPU_MODELS, "")).split(",") if m.strip())
    spec = _mapping(pod.get("spec"), f"{where}.spec")
    priority = spec.get("priority", 0) or 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidSpecError(f"{where}.spec.priority: expected an integer, got {priority!r}")
    return Request(
        name=pod_uid(pod),
        num_gpu=num_gpu,
        gpu_milli=milli,
        gpu_memory_mib=memory,
        gpu_models=models,
        priority=priority,
        owner=str(labels.get(TENANT_LABEL, "")),
    )


def placement_annotations(p: Placement) -> dict[str, str]:
    """What the extender writes on a pod it binds."""
    return {
        NODE_ANNOTATION: p.node,
        CARDS_ANNOTATION: ",".join(str(g) for g in p.gpus),
        MILLI_ANNOTATION: str(p.milli_per_gpu),
    }


def pod_placement(pod: Mapping[str, Any]) -> Placement | None:
    """The placement recorded on a pod by the extender, or None when it has none."""
    where = f"pod {pod_key(pod)}"
    annotations = _mapping(metadata(pod, where).get("annotations"), f"{where}.metadata.annotations")
    if NODE_ANNOTATION not in annotations:
        return None
    try:
        cards = tuple(int(c) for c in str(annotations.get(CARDS_ANNOTATION, "")).split(",") if c != "")
        milli = int(str(annotations.get(MILLI_ANNOTATION, "0")))
    except ValueError:
        raise InvalidSpecError(
            f"{where}: annotations {CARDS_ANNOTATION}={annotations.get(CARDS_ANNOTATION)!r} / "
            f"{MILLI_ANNOTATION}={annotations.get(MILLI_ANNOTATION)!r} are not card indices and milli-GPU"
        ) from None
    return Placement(pod_uid(pod), str(annotations[NODE_ANNOTATION]), cards, milli)


def pod_is_active(pod: Mapping[str, Any]) -> bool:
    """True while a pod holds its resources (not finished, not being deleted past its grace period)."""
    phase = _mapping(pod.get("status"), "pod.status").get("phase")
    return phase not in ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class NodeCards:
    """What a node's labels and annotations say about its cards (the device plugin publishes them)."""

    count: int
    model: str
    memory_mib: int
    nvlink_groups: tuple[int | None, ...] = ()
    unhealthy: frozenset[int] = frozenset()

    def labels(self) -> dict[str, str]:
        return {GPU_COUNT_LABEL: str(self.count), GPU_MODEL_LABEL: self.model, GPU_MEMORY_LABEL: str(self.memory_mib)}

    def annotations(self) -> dict[str, str]:
        groups = ",".join("-" if g is None else str(g) for g in self.nvlink_groups)
        return {NVLINK_ANNOTATION: groups, UNHEALTHY_ANNOTATION: ",".join(str(g) for g in sorted(self.unhealthy))}


def node_cards(node: Node) -> NodeCards:
    """The labels a device plugin publishes for an octacloud ``Node``."""
    return NodeCards(
        node.gpu_count,
        node.gpu_model,
        node.gpus[0].memory_mib if node.gpus else 0,
        tuple(g.nvlink_group for g in node.gpus),
        frozenset(g.index for g in node.gpus if g.health is not Health.HEALTHY),
    )


def node_from_k8s(obj: Mapping[str, Any]) -> Node:
    """An octacloud ``Node`` from a ``v1.Node`` (allocatable CPU and memory; cards from octacloud's labels)."""
    meta = metadata(obj, "node")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidSpecError("node: metadata.name must be a non-empty string")
    where = f"node {name!r}"
    labels = _mapping(meta.get("labels"), f"{where}.metadata.labels")
    annotations = _mapping(meta.get("annotations"), f"{where}.metadata.annotations")
    status = _mapping(obj.get("status"), f"{where}.status")
    allocatable = _mapping(status.get("allocatable") or status.get("capacity"), f"{where}.status.allocatable")
    cpu = parse_quantity(allocatable.get("cpu", 0), f"{where}.status.allocatable.cpu")
    memory = parse_quantity(allocatable.get("memory", 0), f"{where}.status.allocatable.memory")
    count = 0
    if GPU_COUNT_LABEL in labels:
        count = _count(labels[GPU_COUNT_LABEL], f"{where}: label {GPU_COUNT_LABEL}")
    gpus: list[Gpu] = []
    if count:
        if GPU_MEMORY_LABEL not in labels:
            raise InvalidSpecError(f"{where}: label {GPU_MEMORY_LABEL} is missing; run octacloud's device plugin there")
        card_memory = _count(labels[GPU_MEMORY_LABEL], f"{where}: label {GPU_MEMORY_LABEL}")
        model = str(labels.get(GPU_MODEL_LABEL) or "gpu")
        groups = _int_list(annotations.get(NVLINK_ANNOTATION, ""), f"{where}: annotation {NVLINK_ANNOTATION}")
        bad = _int_list(annotations.get(UNHEALTHY_ANNOTATION, ""), f"{where}: annotation {UNHEALTHY_ANNOTATION}")
        unhealthy = {g for g in bad if g is not None}
        for i in range(count):
            group = groups[i] if i < len(groups) else None
            health = Health.FAILED if i in unhealthy else Health.HEALTHY
            gpus.append(Gpu(i, model, card_memory, group, health))
    return Node(
        name=name,
        cpu_milli=int(cpu * 1000),
        memory_mib=int(memory / 2**20),
        gpus=tuple(gpus),
        labels={str(k): str(v) for k, v in labels.items()},
    )


def _int_list(text: object, where: str) -> list[int | None]:
    out: list[int | None] = []
    for part in str(text or "").split(","):
        part = part.strip()
        if part in ("", "-"):
            out.append(None)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise InvalidSpecError(f"{where}: {text!r} must be comma-separated integers (or '-')") from None
    return out if any(g is not None for g in out) else []
