"""Policy plugins, one short module each, and the registry of built-in plugin kinds."""

from __future__ import annotations

from octacloud.scheduler.plugins import (
    bestfit,
    clustering,
    domain_reserve,
    dotprod,
    fgd,
    fit,
    free_resource,
    gpu_type,
    headroom,
    model_cache,
    model_memory,
    octacloud,
    octant,
    packing,
    random,
    replicas,
    spread,
    telemetry,
    topology,
)
from octacloud.scheduler.registry import PluginRegistry

RULE_KINDS = ("octant-unit", "model-memory", "failover-headroom")
"""The product's rules (docs/scheduler.md); profiles that reproduce published results leave them out."""


def builtin_registry() -> PluginRegistry:
    """A fresh registry holding every built-in plugin kind (add your own with ``register``)."""
    reg = PluginRegistry()
    reg.register("resource-fit", fit.build, "filter: CPU, memory, card milli-GPU and memory, GPU model, health")
    reg.register("octant-unit", octant.build, "rule: round GPU shares up to whole octants (125 milli)")
    reg.register("model-memory", model_memory.build, "rule: a model uses at most 80 % of one card's memory")
    reg.register("failover-headroom", headroom.build, "rule: keep 20 % of fleet GPU for failover/high priority")
    reg.register(
        "domain-reserve",
        domain_reserve.build,
        "rule: keep room to re-place what any one failure domain (rack, power feed, zone) holds",
    )
    reg.register(
        "replica-spread",
        replicas.build,
        "filter: a deployment's replicas on different nodes, then racks (soft, or hard per node or rack)",
    )
    reg.register("random-card", random.build, "cards: a random fitting card (published Random baseline)")
    reg.register("dotprod", dotprod.build, "score: published DotProd baseline")
    reg.register("gpu-clustering", clustering.build, "score: published GpuClustering baseline")
    reg.register("gpu-packing", packing.build, "score: published GpuPacking baseline")
    reg.register("bestfit", bestfit.build, "score: published BestFit baseline")
    reg.register("fgd", fgd.build, "score + cards: fragmentation gradient descent (needs a target workload)")
    reg.register(
        "octacloud",
        octacloud.build,
        "score + cards: fragmentation + CPU and memory stranding growth, consolidating (octacloud's)",
    )
    reg.register("spread", spread.build, "score: least allocated node first")
    reg.register("gpu-type", gpu_type.build, "filter + score: allowed, denied, preferred and reserved GPU models")
    reg.register("nvlink-topology", topology.build, "score + cards: multi-card requests within one NVLink group")
    reg.register("telemetry", telemetry.build, "filter + score: one node metric (needs a telemetry source)")
    reg.register("model-cache", model_cache.build, "score: nodes whose model cache holds the request's model")
    reg.register("free-resource", free_resource.build, "score: free share of CPU, memory, GPU or GPU memory")
    return reg


REGISTRY = builtin_registry()
"""The default registry used by profile loading."""

__all__ = ["REGISTRY", "RULE_KINDS", "builtin_registry"]
