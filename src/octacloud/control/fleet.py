"""Fleet discovery: which nodes and cards exist.

Three sources, tried in this order by :func:`discover_fleet`:

1. a fleet file (YAML) that declares nodes — for test fleets, CPU-only machines, or fleets described by hand
   (the format is in docs/cloud.md, "The fleet file");
2. NVML (``nvidia-ml-py``) on this host, when NVIDIA GPUs are present: model, memory, NVLink peers, health;
3. otherwise this host's CPU, carved into CPU "cards": one node (:func:`cpu_host_node`) or a declared demo fleet
   of several nodes (:func:`demo_fleet`, what ``octacloud up`` starts on a machine without GPUs).

A fleet file looks like::

    nodes:
      - name: gpu-a
        cpu_milli: 64000
        memory_mib: 262144
        zone: eu-1                # failure domains (optional): zone, rack, power feed
        rack: r12
        power_feed: pdu-12a
        tariff: {"00:00": 0.12, "07:00": 0.31, "22:00": 0.12}   # price per kWh from each time (UTC)
        gpus:
          - {model: A100, memory_mib: 81920, nvlink_group: 0}
          - {model: A100, memory_mib: 81920, nvlink_group: 0}
      - name: gpu-b
        cpu_milli: 32000
        memory_mib: 131072
        gpu_count: 8            # shorthand: 8 identical cards
        gpu_model: T4
        gpu_memory_mib: 16384
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from octacloud.core.clock import Clock, SystemClock
from octacloud.core.domains import DOMAIN_LABELS, check_domain_name, domain_labels
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Health, Node
from octacloud.scheduler.telemetry import Tariff

CPU_CARD_MODEL = "cpu"
"""The model name of a "card" that is really a share of the host's CPU (machines without GPUs)."""

_DOMAIN_KEYS = ("zone", "rack", "power_feed")
_NODE_KEYS = {
    "name",
    "cpu_milli",
    "memory_mib",
    "labels",
    "gpus",
    "gpu_count",
    "gpu_model",
    "gpu_memory_mib",
    "tariff",
    *_DOMAIN_KEYS,
}
_GPU_KEYS = {"model", "memory_mib", "nvlink_group", "health"}


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(f"{where}: expected an integer, got {value!r}")
    return value


def _check_keys(spec: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise InvalidSpecError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def parse_fleet(data: object, source: str = "<fleet>") -> list[Node]:
    """Nodes from a parsed fleet document; errors name the source, the node and the key."""
    if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list):
        raise InvalidSpecError(f"{source}: a fleet file needs a top-level 'nodes:' list")
    nodes: list[Node] = []
    seen: set[str] = set()
    for k, spec in enumerate(data["nodes"]):
        where = f"{source}: nodes[{k}]"
        if not isinstance(spec, Mapping):
            raise InvalidSpecError(f"{where}: expected a mapping, got {spec!r}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidSpecError(f"{where}: 'name' must be a non-empty string")
        where = f"{source}: node {name!r}"
        _check_keys(spec, _NODE_KEYS, where)
        if name in seen:
            raise InvalidSpecError(f"{where}: duplicate node name")
        seen.add(name)
        gpus = _parse_gpus(spec, where)
        labels = spec.get("labels", {}) or {}
        if not isinstance(labels, Mapping):
            raise InvalidSpecError(f"{where}: 'labels' must be a mapping")
        if "tariff" in spec:
            parse_tariff(spec["tariff"], f"{where}: tariff")
        nodes.append(
            Node(
                name=name,
                cpu_milli=_int(spec.get("cpu_milli"), f"{where}: cpu_milli"),
                memory_mib=_int(spec.get("memory_mib"), f"{where}: memory_mib"),
                gpus=gpus,
                labels=_labels(spec, {str(a): str(b) for a, b in labels.items()}, where),
            )
        )
    return nodes


def _labels(spec: Mapping[str, Any], labels: dict[str, str], where: str) -> dict[str, str]:
    """The node's labels with its failure domains (``zone``, ``rack``, ``power_feed``) written in."""
    for kind in _DOMAIN_KEYS:
        if kind not in spec:
            continue
        value = check_domain_name(kind, spec[kind], f"{where}: {kind}")
        for label in DOMAIN_LABELS[kind]:
            if labels.get(label, value) != value:
                raise InvalidSpecError(
                    f"{where}: {kind} {value!r} disagrees with label {label}={labels[label]!r}; give it once"
                )
        labels.update(domain_labels(**{kind: value}))
    return labels


def _parse_gpus(spec: Mapping[str, Any], where: str) -> tuple[Gpu, ...]:
    if "gpus" in spec and "gpu_count" in spec:
        raise InvalidSpecError(f"{where}: give either 'gpus' or 'gpu_count', not both")
    if "gpu_count" in spec:
        count = _int(spec["gpu_count"], f"{where}: gpu_count")
        model = spec.get("gpu_model")
        if not isinstance(model, str) or not model:
            raise InvalidSpecError(f"{where}: 'gpu_model' is required with 'gpu_count'")
        memory = _int(spec.get("gpu_memory_mib"), f"{where}: gpu_memory_mib")
        return tuple(Gpu(i, model, memory) for i in range(count))
    gpus = spec.get("gpus", []) or []
    if not isinstance(gpus, list):
        raise InvalidSpecError(f"{where}: 'gpus' must be a list")
    out: list[Gpu] = []
    for i, g in enumerate(gpus):
        gw = f"{where}: gpus[{i}]"
        if not isinstance(g, Mapping):
            raise InvalidSpecError(f"{gw}: expected a mapping, got {g!r}")
        _check_keys(g, _GPU_KEYS, gw)
        model = g.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidSpecError(f"{gw}: 'model' must be a non-empty string")
        group = g.get("nvlink_group")
        try:
            health = Health(g.get("health", "healthy"))
        except ValueError:
            raise InvalidSpecError(f"{gw}: health must be one of {[h.value for h in Health]}") from None
        out.append(
            Gpu(
                i,
                model,
                _int(g.get("memory_mib"), f"{gw}: memory_mib"),
                None if group is None else _int(group, f"{gw}: nvlink_group"),
                health,
            )
        )
    return tuple(out)


def parse_tariff(value: object, where: str) -> Tariff:
    """A tariff from ``{"HH:MM": price per kWh, ...}`` (UTC; each price holds until the next time)."""
    if not isinstance(value, Mapping) or not value:
        raise InvalidSpecError(f'{where}: expected a mapping of "HH:MM" to a price per kWh, got {value!r}')
    steps: list[tuple[int, float]] = []
    for at, price in value.items():
        minute = _minute_of_day(at, where)
        if isinstance(price, bool) or not isinstance(price, int | float) or not 0 <= price < float("inf"):
            raise InvalidSpecError(f"{where}: {at}: the price must be a number >= 0, got {price!r}")
        steps.append((minute, float(price)))
    steps.sort()
    if len({m for m, _ in steps}) != len(steps):
        raise InvalidSpecError(f"{where}: a time of day is given twice")
    return Tariff(tuple(steps))


def _minute_of_day(at: object, where: str) -> int:
    """``"HH:MM"`` as minutes after midnight; an integer is taken as that already (YAML reads an unquoted
    ``07:00`` as the base-60 number 420, which is its minute of the day)."""
    if isinstance(at, int) and not isinstance(at, bool) and 0 <= at < 24 * 60:
        return at
    hour, colon, minute = str(at).partition(":")
    if not (colon and hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
        raise InvalidSpecError(f'{where}: {at!r} is not a time of day "HH:MM" (00:00 to 23:59)')
    return int(hour) * 60 + int(minute)


def fleet_tariffs(data: object, source: str = "<fleet>") -> dict[str, Tariff]:
    """Node name → its tariff, for the nodes of a fleet document that have one (the document parses)."""
    parse_fleet(data, source)
    assert isinstance(data, Mapping)
    return {
        str(spec["name"]): parse_tariff(spec["tariff"], f"{source}: node {spec['name']!r}: tariff")
        for spec in data["nodes"]
        if "tariff" in spec
    }


def read_fleet_document(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidSpecError(f"cannot read fleet file {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpecError(f"{path}: not valid YAML: {exc}") from None


def load_fleet_file(path: Path) -> list[Node]:
    return parse_fleet(read_fleet_document(path), str(path))


def cpu_host_node(name: str | None = None, cards: int = 1) -> Node:
    """This host as one node whose ``cards`` "cards" are shares of its CPU.

    On a machine without GPUs replicas compute on the CPU. Each pseudo-card stands for ``cores / cards`` of
    the host's cores and half of the host's memory split evenly (the memory a replica may use for tensors);
    an octant of a pseudo-card is therefore 1/8 of that CPU share, which the launcher turns into an
    onnxruntime thread budget. The node's own CPU and memory are the host's.
    """
    cores = os.cpu_count() or 1
    memory_mib = _host_memory_mib()
    card_memory = memory_mib // 2 // max(cards, 1)
    gpus = tuple(Gpu(i, CPU_CARD_MODEL, card_memory) for i in range(cards))
    return Node(
        name=name or socket.gethostname() or "localhost",
        cpu_milli=cores * 1000,
        memory_mib=memory_mib,
        gpus=gpus,
        labels={"octacloud.io/accelerator": "cpu", "octacloud.io/cores": str(cores)},
    )


def _host_memory_mib() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 4096


DEMO_LABEL = "octacloud.io/demo"
"""Label of the nodes of a demo fleet: they are shares of one host, not machines of their own."""


def demo_fleet(nodes: int = 2, cards: int = 4, host: str | None = None) -> list[Node]:
    """A declared demo fleet carved out of this host: ``nodes`` nodes of ``cards`` CPU "cards" each.

    For trying octacloud on a machine without GPUs: packing, scaling, preemption and failover behave as on a
    real fleet. The nodes are named ``demo-a``, ``demo-b``, ...; each stands for ``1/nodes`` of the host's
    cores and memory, and its cards split half of that memory evenly (as :func:`cpu_host_node` does). Every
    replica still runs on this host; a node's cores become its replicas' thread budgets.
    """
    if not 1 <= nodes <= 26:
        raise InvalidSpecError(f"a demo fleet has 1 to 26 nodes, got {nodes}")
    if not 1 <= cards <= 64:
        raise InvalidSpecError(f"a demo node has 1 to 64 cards, got {cards}")
    cores = os.cpu_count() or 1
    memory_mib = _host_memory_mib() // nodes
    card_memory = memory_mib // 2 // cards
    where = host or socket.gethostname() or "localhost"
    return [
        Node(
            name=f"demo-{chr(ord('a') + i)}",
            cpu_milli=max(1000, cores * 1000 // nodes),
            memory_mib=memory_mib,
            gpus=tuple(Gpu(g, CPU_CARD_MODEL, card_memory) for g in range(cards)),
            labels={"octacloud.io/accelerator": "cpu", DEMO_LABEL: where},
        )
        for i in range(nodes)
    ]


def nvml_host_node(name: str | None = None) -> Node | None:
    """This host's NVIDIA GPUs through NVML, or ``None`` when NVML or GPUs are absent."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no NVIDIA GPUs here
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        groups = _nvlink_groups(pynvml, handles)
        gpus = []
        for i, h in enumerate(handles):
            model = pynvml.nvmlDeviceGetName(h)
            model = model.decode() if isinstance(model, bytes) else str(model)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024)
            gpus.append(
                Gpu(i, model.replace("NVIDIA ", "").replace(" ", "-"), memory, groups[i], _nvml_health(pynvml, h))
            )
        cores = os.cpu_count() or 1
        return Node(
            name=name or socket.gethostname() or "localhost",
            cpu_milli=cores * 1000,
            memory_mib=_host_memory_mib(),
            gpus=tuple(gpus),
            labels={"octacloud.io/accelerator": "nvidia"},
        )
    finally:
        pynvml.nvmlShutdown()


def _nvlink_groups(pynvml: Any, handles: Sequence[Any]) -> list[int | None]:
    """Cards connected by active NVLinks share a group (union-find over NVLink peers)."""
    parent = list(range(len(handles)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    bus_ids = {}
    for i, h in enumerate(handles):
        bus_ids[str(pynvml.nvmlDeviceGetPciInfo(h).busId).lower()] = i
    linked = [False] * len(handles)
    for i, h in enumerate(handles):
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                peer = str(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
            except Exception:  # NVMLError_NotSupported on PCIe cards, or link index out of range
                break
            j = bus_ids.get(peer)
            if j is not None:
                linked[i] = linked[j] = True
                parent[find(i)] = find(j)
    return [find(i) if linked[i] else None for i in range(len(handles))]


def _nvml_health(pynvml: Any, handle: Any) -> Health:
    """Degraded when the card reports uncorrected ECC errors or pending page retirement."""
    try:
        volatile = pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
        if volatile > 0:
            return Health.DEGRADED
    except Exception:  # ECC not supported (consumer cards): nothing to say
        pass
    return Health.HEALTHY


def discover_fleet(fleet_file: Path | None = None, *, cpu_cards: int = 1, cpu_nodes: int = 1) -> list[Node]:
    """The fleet: the fleet file if given, else this host through NVML, else this host's CPU as ``cpu_nodes``
    node(s) of ``cpu_cards`` cards (one node: this host by name; more: a demo fleet, see :func:`demo_fleet`)."""
    if fleet_file is not None:
        return load_fleet_file(fleet_file)
    node = nvml_host_node()
    if node is not None:
        return [node]
    return [cpu_host_node(cards=cpu_cards)] if cpu_nodes == 1 else demo_fleet(cpu_nodes, cpu_cards)


@dataclass(slots=True)
class HealthEvent:
    at: float
    node: str
    gpu: int | None
    health: Health
    reason: str


@dataclass(slots=True)
class FleetHealth:
    """Node and card health tracked over time: the current state and the history of transitions."""

    clock: Clock = field(default_factory=SystemClock)
    current: dict[tuple[str, int | None], Health] = field(default_factory=dict)
    history: list[HealthEvent] = field(default_factory=list)

    def observe(self, node: str, health: Health, reason: str = "", gpu: int | None = None) -> bool:
        """Record an observation; returns True when it changes the node's (or card's) health."""
        key = (node, gpu)
        changed = self.current.get(key, Health.HEALTHY) is not health  # everything starts healthy
        self.current[key] = health
        if changed:
            self.history.append(HealthEvent(self.clock.time(), node, gpu, health, reason))
        return changed

    def health(self, node: str, gpu: int | None = None) -> Health:
        return self.current.get((node, gpu), Health.HEALTHY)
