"""Named scheduling policies: the six published baselines, ``spread``, the product default, and profile files.

``build_profile(name, seed=..., workload=...)`` returns a ready :class:`Profile`. ``name`` is a built-in profile
(``random``, ``dotprod``, ``clustering``, ``packing``, ``bestfit``, ``fgd``, ``spread``, ``octacloud``,
``cpu-idle-sketch``, ``multi-objective``) or the path of a YAML/TOML profile file.

The product's rules (octant unit, 80 % card memory, 20 % failover headroom) are switched by ``rules``: ``False``
removes them from any profile (trace comparability: the published protocol counts raw milli-GPU and has no
reserve), ``True`` adds those missing. The published profiles are written without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from octacloud.core.model import Request
from octacloud.core.units import MILLI_PER_GPU, MILLI_PER_OCTANT, OCTANTS_PER_GPU
from octacloud.scheduler.fragmentation import TargetWorkload
from octacloud.scheduler.framework.runner import Profile
from octacloud.scheduler.plugins import REGISTRY, RULE_KINDS
from octacloud.scheduler.plugins.headroom import FailoverHeadroom
from octacloud.scheduler.plugins.model_cache import CachedModels
from octacloud.scheduler.plugins.model_memory import ModelMemoryLimit
from octacloud.scheduler.plugins.octant import OctantUnit
from octacloud.scheduler.plugins.replicas import ReplicaSpread
from octacloud.scheduler.profiles import builtin_profile_names, builtin_profile_path, load_profile
from octacloud.scheduler.registry import PluginContext
from octacloud.scheduler.telemetry import TelemetrySource

POLICY_IDS: Mapping[str, str] = MappingProxyType(
    {
        "random": "01-Random",
        "dotprod": "02-DotProd",
        "clustering": "03-GpuClustering",
        "packing": "04-GpuPacking",
        "bestfit": "05-BestFit",
        "fgd": "06-FGD",
    }
)
"""CLI name → the policy ID the FGD authors' published results use."""

PRODUCT_DEFAULT = "octacloud"
"""The profile the product schedules with unless told otherwise."""


def slice_prior() -> TargetWorkload:
    """The workload fragmentation-aware placement plans for before it has seen any: every slice size the
    product sells (1..8 octants of one card, one or two whole cards) equally likely."""
    sizes = [Request("prior", num_gpu=1, gpu_milli=k * MILLI_PER_OCTANT) for k in range(1, OCTANTS_PER_GPU + 1)]
    sizes.append(Request("prior", num_gpu=2, gpu_milli=MILLI_PER_GPU))
    return TargetWorkload.from_requests(sizes, coverage=1.0)


def cloud_profile(
    policy: str = PRODUCT_DEFAULT, telemetry: TelemetrySource | None = None, model_cache: CachedModels | None = None
) -> Profile:
    """The profile the cloud schedules with (``octacloud up`` and the Kubernetes extender alike): ``policy``,
    seed 0, the product's slice sizes as the prior workload, and the product's rules. ``model_cache`` tells a
    profile's ``model-cache`` term which nodes hold which models."""
    return build_profile(
        policy, seed=0, workload=slice_prior(), rules=True, telemetry=telemetry, model_cache=model_cache
    )


def policy_names() -> list[str]:
    """Every built-in profile name (published first)."""
    return [*POLICY_IDS, *(n for n in builtin_profile_names() if n not in POLICY_IDS)]


def build_profile(
    name: str,
    *,
    seed: int,
    workload: TargetWorkload | None = None,
    rules: bool = False,
    telemetry: TelemetrySource | None = None,
    model_cache: CachedModels | None = None,
) -> Profile:
    """The profile called ``name`` (built-in, or a profile file path), seeded with ``seed``."""
    context = PluginContext(seed=seed, workload=workload, telemetry=telemetry, model_cache=model_cache)
    path = Path(name) if name.endswith((".yaml", ".yml", ".toml")) else builtin_profile_path(name)
    profile = load_profile(path, context=context, registry=REGISTRY)
    return with_rules(profile) if rules else without_rules(profile)


def without_rules(profile: Profile) -> Profile:
    """``profile`` without the product's rules (octant unit, 80 % card memory, failover headroom)."""
    rule_types = (OctantUnit, ModelMemoryLimit, FailoverHeadroom)
    profile.rewriters = [p for p in profile.rewriters if not isinstance(p, rule_types)]
    profile.pre_filters = [p for p in profile.pre_filters if not isinstance(p, rule_types)]
    profile.filters = [p for p in profile.filters if not isinstance(p, rule_types)]
    return profile


def with_rules(profile: Profile) -> Profile:
    """``profile`` with each of the product's rules it lacks, with default settings, and a deployment's replicas
    kept apart (``replica-spread``; it only looks at requests of a group, so ``without_rules`` keeps it)."""
    if not any(isinstance(p, OctantUnit) for p in profile.rewriters):
        profile.rewriters.insert(0, OctantUnit())
    if not any(isinstance(p, FailoverHeadroom) for p in profile.pre_filters):
        profile.pre_filters.insert(0, FailoverHeadroom())
    if not any(isinstance(p, ModelMemoryLimit) for p in profile.filters):
        rule = ModelMemoryLimit()
        profile.pre_filters.append(rule)
        profile.filters.insert(0, rule)
    if not any(isinstance(p, ReplicaSpread) for p in profile.filters):
        spread = ReplicaSpread()
        profile.pre_filters.append(spread)
        profile.filters.append(spread)  # last: it keeps the best of what the other filters left
    return profile


__all__ = [
    "POLICY_IDS",
    "PRODUCT_DEFAULT",
    "RULE_KINDS",
    "build_profile",
    "cloud_profile",
    "policy_names",
    "slice_prior",
    "with_rules",
    "without_rules",
]
