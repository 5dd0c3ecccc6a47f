"""A server's inventory as Ray node resources and labels, and back.

Every octacloud node is a Ray node that advertises, besides Ray's own ``CPU`` and ``memory``:

* one resource per card, ``gpu<i>_octant: 8`` — the eight octants of card ``i``. A replica actor asks for
  exactly its slice (``{"gpu3_octant": 2}``, or ``{"gpu0_octant": 8, "gpu1_octant": 8}`` for two whole
  cards) on the node the scheduler chose, so Ray refuses or queues anything our accounting got wrong;
* a marker, ``octacloud_node:<name>: 1``, that names the node in octacloud's fleet;
* labels for what resources cannot say: the card model, its memory, NVLink groups, and the node's failure
  domains (``octacloud.io/zone``, ``octacloud.io/rack``, ``octacloud.io/power-feed``). A cluster whose nodes
  were started without labels may declare domains as marker resources instead, ``octacloud_rack:<name>: 1``
  (likewise ``octacloud_zone:`` and ``octacloud_power_feed:``); a label wins over a marker.

Ray does not know about cards here (``num_gpus`` is left to NVML-less defaults and replicas ask for
``num_gpus=0``): the octant resources are the only GPU accounting Ray sees, and the slice environment
(``CUDA_VISIBLE_DEVICES``, MPS limits) binds the replica to its card, exactly as for local replicas.

This module is pure (no Ray import) so that the mapping is testable on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from octacloud.core.domains import DOMAIN_LABELS, check_domain_name
from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Gpu, Node
from octacloud.core.units import OCTANTS_PER_GPU

NODE_MARKER = "octacloud_node:"
DOMAIN_MARKERS = {"zone": "octacloud_zone:", "rack": "octacloud_rack:", "power_feed": "octacloud_power_feed:"}
"""Marker resources that declare a node's failure domains on a cluster started without labels."""
LABEL_MODEL = "octacloud.io/gpu-model"
LABEL_MEMORY = "octacloud.io/gpu-memory-mib"
LABEL_NVLINK = "octacloud.io/nvlink-groups"
LABEL_PREFIX = "octacloud.io/"
_OCTANT = re.compile(r"^gpu(\d+)_octant$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,61}[A-Za-z0-9]|[A-Za-z0-9])$")
_NO_LINK = "x"

FAST_FAILURE_DETECTION: dict[str, int] = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 1000,
}
"""GCS health-check settings for a head node: a dead node is seen in about 1.3 s (Ray's default: ~30 s)."""


def octant_resource(card: int) -> str:
    """The Ray resource that counts the free octants of card ``card`` on every node."""
    return f"gpu{card}_octant"


def slice_resources(gpus: tuple[int, ...], milli_per_gpu: int) -> dict[str, float]:
    """What a replica on cards ``gpus`` taking ``milli_per_gpu`` of each asks Ray for."""
    octants = milli_per_gpu * OCTANTS_PER_GPU // 1000
    return {octant_resource(g): float(octants) for g in gpus}


def node_resources(node: Node) -> dict[str, float]:
    """Custom resources a Ray node advertises for ``node`` (Ray adds CPU and memory itself)."""
    resources = {octant_resource(g.index): float(OCTANTS_PER_GPU) for g in node.gpus}
    resources[NODE_MARKER + node.name] = 1.0
    return resources


def node_labels(node: Node) -> dict[str, str]:
    """Labels a Ray node carries for ``node``: the card model and memory (one per node: octacloud's nodes are
    homogeneous) and the NVLink group of each card, plus the node's own labels under ``octacloud.io/``."""
    labels: dict[str, str] = {}
    for key, value in node.labels.items():
        name = key.split("/", 1)[1] if key.startswith(LABEL_PREFIX) else key
        labels[LABEL_PREFIX + name.replace("/", ".")] = value
    if node.gpus:
        models = {g.model for g in node.gpus}
        memories = {g.memory_mib for g in node.gpus}
        if len(models) > 1 or len(memories) > 1:
            raise InvalidSpecError(
                f"node {node.name!r}: cards differ ({sorted(models)}, {sorted(memories)} MiB); a Ray node advertises "
                "one card model and size: split the server into one fleet node per kind of card"
            )
        labels[LABEL_MODEL] = node.gpus[0].model
        labels[LABEL_MEMORY] = str(node.gpus[0].memory_mib)
        if any(g.nvlink_group is not None for g in node.gpus):
            labels[LABEL_NVLINK] = "-".join(
                _NO_LINK if g.nvlink_group is None else str(g.nvlink_group) for g in node.gpus
            )
    for key, value in labels.items():
        if value and not _LABEL_VALUE.match(value):
            raise InvalidSpecError(
                f"node {node.name!r}: label {key}={value!r} is not a valid Ray label value "
                "(up to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"
            )
    return labels


def node_name(entry: Mapping[str, Any]) -> str | None:
    """The octacloud node name of a ``ray.nodes()`` entry, or None for a Ray node that is not one of ours."""
    for key in entry.get("Resources", {}) or {}:
        if key.startswith(NODE_MARKER):
            return str(key[len(NODE_MARKER) :])
    return None


def node_from_ray(entry: Mapping[str, Any]) -> Node | None:
    """The octacloud node a ``ray.nodes()`` entry advertises (total capacity), or None when it is not ours.

    Resources of a dead node may be reported empty by Ray: read them from the entry seen while it was alive.
    """
    name = node_name(entry)
    if name is None:
        return None
    resources: Mapping[str, float] = entry.get("Resources", {}) or {}
    labels: Mapping[str, str] = entry.get("Labels", {}) or {}
    cards = sorted(int(m.group(1)) for key in resources if (m := _OCTANT.match(key)))
    if cards != list(range(len(cards))):
        raise InvalidSpecError(f"Ray node {name!r}: card resources must be gpu0_octant..gpuN_octant, got {cards}")
    model = labels.get(LABEL_MODEL, "")
    try:
        memory = int(labels.get(LABEL_MEMORY, "0"))
    except ValueError:
        raise InvalidSpecError(f"Ray node {name!r}: label {LABEL_MEMORY} must be an integer") from None
    if cards and not model:
        raise InvalidSpecError(f"Ray node {name!r} advertises cards but no {LABEL_MODEL} label")
    links = labels.get(LABEL_NVLINK, "").split("-") if labels.get(LABEL_NVLINK) else [_NO_LINK] * len(cards)
    if len(links) != len(cards) or not all(x == _NO_LINK or x.isdigit() for x in links):
        raise InvalidSpecError(f"Ray node {name!r}: label {LABEL_NVLINK} must give one group (or x) per card")
    gpus = tuple(Gpu(i, model, memory, None if links[i] == _NO_LINK else int(links[i])) for i in cards)
    own = {
        k: v
        for k, v in labels.items()
        if k.startswith(LABEL_PREFIX) and k not in (LABEL_MODEL, LABEL_MEMORY, LABEL_NVLINK)
    }
    own.update({k: v for k, v in _domain_markers(name, resources).items() if k not in own})
    return Node(
        name=name,
        cpu_milli=int(float(resources.get("CPU", 0)) * 1000),
        memory_mib=int(float(resources.get("memory", 0))) // 2**20,
        gpus=gpus,
        labels=own,
    )


def _domain_markers(name: str, resources: Mapping[str, float]) -> dict[str, str]:
    """The domain labels a node's marker resources declare (one marker per kind at most)."""
    out: dict[str, str] = {}
    for kind, marker in DOMAIN_MARKERS.items():
        values = sorted(key[len(marker) :] for key in resources if key.startswith(marker))
        if len(values) > 1:
            raise InvalidSpecError(f"Ray node {name!r}: more than one {marker}<name> resource: {values}")
        if values:
            out[DOMAIN_LABELS[kind][0]] = check_domain_name(kind, values[0], f"Ray node {name!r}: {marker}")
    return out


def ray_start_command(
    node: Node,
    *,
    ray: str,
    head: bool,
    address: str | None = None,
    port: int = 6379,
    node_ip: str | None = None,
    system_config: Mapping[str, int] | None = None,
    block: bool = False,
) -> list[str]:
    """The ``ray start`` command line that makes this server the octacloud node ``node``.

    Ray's own GPU accounting is turned off (``--num-gpus=0``): cards are counted in octant resources only,
    so that nothing outside octacloud's scheduler books a card twice. The dashboard is off and usage
    statistics are disabled by the caller's environment (``RAY_USAGE_STATS_ENABLED=0``).
    """
    if head == (address is not None):
        raise InvalidSpecError("give either --head (start a cluster) or --address (join one), not both or neither")
    argv = [ray, "start"]
    argv += ["--head", f"--port={port}"] if head else [f"--address={address}"]
    argv += [
        f"--num-cpus={max(1, node.cpu_milli // 1000)}",
        "--num-gpus=0",
        f"--resources={json.dumps(node_resources(node), sort_keys=True)}",
        "--include-dashboard=false",
    ]
    labels = node_labels(node)
    if labels:
        argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
    if node_ip:
        argv.append(f"--node-ip-address={node_ip}")
    if head and system_config:
        argv.append(f"--system-config={json.dumps(dict(system_config), sort_keys=True)}")
    if block:
        argv.append("--block")
    return argv
