"""Seeded generators of openb-format workloads and fleets, so that a policy is judged on traces it was not tuned on.

* :func:`restrict_workload` turns a trace into a *family*: a share of its GPU request restricted (``gpu_spec``) to
  one or several GPU model sets, and optionally another CPU-to-GPU (and memory-to-GPU) ratio. Spec strings:
  ``0.10@G3`` (10 % of the trace's GPU request restricted to G3), ``0.05@V100M16|V100M32`` (to either model; a
  set is joined by ``|``), several items separated by ``,``, plus ``cpu=1.5`` / ``mem=0.5`` (scale the CPU /
  memory request of every GPU pod). Which pods are restricted is drawn with the seed; only pods that fit some
  node of the set (cards, CPU, memory) are restricted, so every pod stays placeable on an empty fleet.
* :func:`generate_fleet` writes a fleet of ``--gpus``-card nodes of the given models in the given proportions
  (with a ``gpu_memory_mib`` column, so any model name works); :func:`sample_fleet` keeps a seeded, stratified
  fraction of a node file (every node kind keeps its share; CPU-only nodes included) to make runs cheaper.
* :data:`SUITE` is the documented robustness suite (fleets and families) that :func:`write_suite` materialises.

Everything is a pure function of its inputs and seed: the same command writes the same bytes.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from octacloud.core.errors import InvalidSpecError
from octacloud.core.model import Node, Request
from octacloud.core.units import gib_to_mib
from octacloud.sim.traces import GPU_MEMORY_MIB, read_nodes, read_pods

POD_HEADER = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec")
NODE_HEADER = ("sn", "cpu_milli", "memory_mib", "gpu", "model", "gpu_memory_mib")


# ---- workloads -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A family's transformation of a base trace: restricted shares per model set, CPU and memory scale."""

    restrict: tuple[tuple[float, frozenset[str]], ...] = ()
    cpu_scale: float = 1.0
    memory_scale: float = 1.0

    def __str__(self) -> str:
        items = [f"{share:g}@{'|'.join(sorted(models))}" for share, models in self.restrict]
        if self.cpu_scale != 1.0:
            items.append(f"cpu={self.cpu_scale:g}")
        if self.memory_scale != 1.0:
            items.append(f"mem={self.memory_scale:g}")
        return ",".join(items) or "none"

    @property
    def restricted_share(self) -> float:
        return math.fsum(share for share, _ in self.restrict)


def parse_workload_spec(text: str) -> WorkloadSpec:
    """``SHARE@MODEL[|MODEL...]`` items, ``cpu=X`` and ``mem=X``, comma-separated; ``none`` = no change."""
    restrict: list[tuple[float, frozenset[str]]] = []
    scales = {"cpu": 1.0, "mem": 1.0}
    if text.strip().lower() in ("", "none"):
        return WorkloadSpec()
    for item in (i.strip() for i in text.split(",")):
        if not item:
            raise InvalidSpecError(f"workload spec {text!r}: empty item")
        key, eq, value = item.partition("=")
        if eq:
            if key.strip() not in scales:
                raise InvalidSpecError(f"workload spec {text!r}: unknown key {key!r} (cpu=X or mem=X)")
            scale = _number(text, value)
            if not 0 < scale <= 10:
                raise InvalidSpecError(f"workload spec {text!r}: {key} scale must be in (0, 10], got {scale:g}")
            scales[key.strip()] = scale
            continue
        share_text, at, models_text = item.partition("@")
        if not at:
            raise InvalidSpecError(f"workload spec {text!r}: {item!r} is not SHARE@MODELS, cpu=X or mem=X")
        share = _number(text, share_text)
        models = frozenset(m.strip() for m in models_text.split("|") if m.strip())
        if not 0 < share <= 1 or not models:
            raise InvalidSpecError(f"workload spec {text!r}: {item!r} needs a share in (0, 1] and at least one model")
        restrict.append((share, models))
    spec = WorkloadSpec(tuple(restrict), scales["cpu"], scales["mem"])
    if spec.restricted_share > 1 + 1e-9:
        raise InvalidSpecError(f"workload spec {text!r}: restricted shares add up to more than 1")
    return spec


def _number(text: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise InvalidSpecError(f"workload spec {text!r}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise InvalidSpecError(f"workload spec {text!r}: {value!r} is not finite")
    return number


def _fits_empty(request: Request, node: Node) -> bool:
    return (
        request.cpu_milli <= node.cpu_milli
        and request.memory_mib <= node.memory_mib
        and (request.num_gpu == 0 or (node.gpu_count >= request.num_gpu and request.allows_model(node.gpu_model)))
    )


def restrict_workload(
    pods: Sequence[Request], nodes: Sequence[Node], spec: WorkloadSpec, *, seed: int
) -> tuple[list[Request], dict[str, object]]:
    """The family of ``pods`` under ``spec`` on the fleet ``nodes``, and a description (realised shares, the load
    each model set's restricted demand puts on its capacity).

    Scaling comes first: a GPU pod's CPU (memory) becomes ``round(request × scale)``, capped at the largest node
    that could host its cards. Then, for each ``(share, models)`` in order, pods not yet restricted are visited
    in a seeded random order and restricted to ``models`` while they fit some node of those models and the
    restricted GPU request stays within ``share`` of the trace's total.
    """
    rng = random.Random(seed)
    out = [_scaled(p, nodes, spec) for p in pods]
    total = sum(p.total_gpu_milli for p in out)
    if total <= 0:
        raise InvalidSpecError("workload generator: the base trace asks for no GPU")
    capacity = sum(n.gpu_milli for n in nodes)
    restricted: set[int] = set()
    sets: list[dict[str, object]] = []
    for share, models in spec.restrict:
        eligible = [n for n in nodes if n.gpu_count and n.gpu_model in models]
        if not eligible:
            raise InvalidSpecError(
                f"workload generator: no node of {'|'.join(sorted(models))} in the fleet "
                f"(models: {sorted({n.gpu_model for n in nodes if n.gpu_count})})"
            )
        budget = share * total
        order = [k for k, p in enumerate(out) if p.num_gpu and k not in restricted]
        rng.shuffle(order)
        taken = 0
        for k in order:
            candidate = replace(out[k], gpu_models=models)
            if taken + candidate.total_gpu_milli > budget or not any(_fits_empty(candidate, n) for n in eligible):
                continue
            out[k] = candidate
            restricted.add(k)
            taken += candidate.total_gpu_milli
        set_capacity = sum(n.gpu_milli for n in eligible)
        sets.append(
            {
                "models": "|".join(sorted(models)),
                "share_asked": share,
                "share_realised": round(taken / total, 4),
                "capacity_share": round(set_capacity / capacity, 4),
                "load_at_100pct_arrived": round(taken / total * capacity / set_capacity, 3),
            }
        )
    description: dict[str, object] = {
        "spec": str(spec),
        "seed": seed,
        "pods": len(out),
        "restricted_pods": len(restricted),
        "restricted_share": round(sum(out[k].total_gpu_milli for k in restricted) / total, 4),
        "sets": sets,
    }
    return out, description


def _scaled(pod: Request, nodes: Sequence[Node], spec: WorkloadSpec) -> Request:
    if not pod.num_gpu or (spec.cpu_scale == 1.0 and spec.memory_scale == 1.0):
        return pod
    hosts = [n for n in nodes if n.gpu_count >= pod.num_gpu and pod.allows_model(n.gpu_model)]
    if not hosts:
        return pod
    cpu = min(round(pod.cpu_milli * spec.cpu_scale), max(n.cpu_milli for n in hosts))
    memory = min(round(pod.memory_mib * spec.memory_scale), max(n.memory_mib for n in hosts))
    return replace(pod, cpu_milli=max(cpu, 0), memory_mib=max(memory, 0))


def write_pods(path: Path, pods: Iterable[Request]) -> None:
    """An openb pod file (``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec``)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(POD_HEADER)
        for p in pods:
            spec = "|".join(sorted(p.gpu_models))
            writer.writerow((p.name, p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, spec))


# ---- fleets ----------------------------------------------------------------------------------------------


def parse_mix(text: str) -> list[tuple[str, float]]:
    """``A100-80G:3,H800:1`` → models with relative weights (> 0)."""
    mix: list[tuple[str, float]] = []
    for item in (i.strip() for i in text.split(",")):
        model, colon, weight = item.partition(":")
        try:
            value = float(weight) if colon else 1.0
        except ValueError:
            raise InvalidSpecError(f"--mix {text!r}: {weight!r} is not a number") from None
        if not model.strip() or not value > 0 or not math.isfinite(value):
            raise InvalidSpecError(f"--mix {text!r}: each item is MODEL[:WEIGHT] with a weight > 0")
        mix.append((model.strip(), value))
    if len({m for m, _ in mix}) != len(mix):
        raise InvalidSpecError(f"--mix {text!r}: a model appears twice")
    return mix


def generate_fleet(
    count: int,
    mix: Sequence[tuple[str, float]],
    *,
    gpus: int = 8,
    cpu_cores: Sequence[int] = (128,),
    memory_gib: Sequence[int] = (1024,),
    gpu_memory_gib: dict[str, int] | None = None,
    seed: int,
) -> list[tuple[str, int, int, int, str, int]]:
    """``count`` nodes of ``gpus`` cards, models in proportion to ``mix`` (largest remainder, then shuffled with
    the seed), CPU and memory drawn from the given choices. Rows in :data:`NODE_HEADER` order."""
    if count < 1 or not 1 <= gpus <= 16 or not mix or not cpu_cores or not memory_gib:
        raise InvalidSpecError("fleet generator: need >= 1 node, 1..16 GPUs per node, a mix, CPU and memory sizes")
    memory_table = {**GPU_MEMORY_MIB, **{m: gib_to_mib(g) for m, g in (gpu_memory_gib or {}).items()}}
    missing = [m for m, _ in mix if m not in memory_table]
    if missing:
        raise InvalidSpecError(f"fleet generator: no card memory for {missing}; give it as MODEL=GiB")
    rng = random.Random(seed)
    weight = math.fsum(w for _, w in mix)
    exact = [count * w / weight for _, w in mix]
    numbers = [math.floor(e) for e in exact]
    for k in sorted(range(len(mix)), key=lambda k: numbers[k] - exact[k])[: count - sum(numbers)]:
        numbers[k] += 1
    models = [m for (m, _), n in zip(mix, numbers, strict=True) for _ in range(n)]
    rng.shuffle(models)
    return [
        (
            f"gen-node-{i:05d}",
            1000 * rng.choice(list(cpu_cores)),
            gib_to_mib(rng.choice(list(memory_gib))),
            gpus,
            model,
            memory_table[model],
        )
        for i, model in enumerate(models)
    ]


def sample_fleet(nodes: Sequence[Node], fraction: float, *, seed: int) -> list[tuple[str, int, int, int, str, int]]:
    """A seeded stratified sample: of each node kind (model, cards, CPU, memory) ``round(n × fraction)`` nodes
    (at least one), in the file's order."""
    if not 0 < fraction <= 1:
        raise InvalidSpecError(f"--fraction must be in (0, 1], got {fraction}")
    rng = random.Random(seed)
    kinds: dict[tuple[str, int, int, int], list[int]] = {}
    for k, n in enumerate(nodes):
        kinds.setdefault((n.gpu_model, n.gpu_count, n.cpu_milli, n.memory_mib), []).append(k)
    keep: set[int] = set()
    for members in kinds.values():
        keep.update(rng.sample(members, max(1, round(len(members) * fraction))))
    return [_node_row(nodes[k]) for k in sorted(keep)]


def _node_row(n: Node) -> tuple[str, int, int, int, str, int]:
    return (n.name, n.cpu_milli, n.memory_mib, n.gpu_count, n.gpu_model, n.gpus[0].memory_mib if n.gpus else 0)


def write_nodes(path: Path, rows: Iterable[tuple[str, int, int, int, str, int]]) -> None:
    """An openb node file with the ``gpu_memory_mib`` column (empty for CPU-only nodes)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(NODE_HEADER)
        for name, cpu, memory, gpus, model, card in rows:
            writer.writerow((name, cpu, memory, gpus, model, card if gpus else ""))


# ---- the robustness suite --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SuiteFleet:
    name: str
    kind: str
    """``sample`` (of ``source`` at ``fraction``) or ``generate`` (``mix`` of ``gpus``-card nodes)."""
    source: str = ""
    fraction: float = 1.0
    count: int = 0
    mix: str = ""
    gpus: int = 8
    cpu_cores: tuple[int, ...] = (128,)
    memory_gib: tuple[int, ...] = (1024,)


@dataclass(frozen=True, slots=True)
class SuiteFamily:
    name: str
    base: str
    """Stem of the base trace in the traces folder (``openb_pod_list_default``)."""
    fleet: str
    spec: str


SUITE_SEED = 7
"""Seed of every generator call of the suite (families and fleets); run seeds are separate (42–51)."""

SUITE_FLEETS: tuple[SuiteFleet, ...] = (
    SuiteFleet("openb-quarter", "sample", "openb_node_list_gpu_node.csv", 0.25),
    SuiteFleet("openb-cpu-quarter", "sample", "openb_node_list_all_node.csv", 0.25),
    SuiteFleet(
        "hetero8",
        "generate",
        count=200,
        mix="A100-80G:3,H800:1,A10:3.5,L40:2.5",
        cpu_cores=(96, 128),
        memory_gib=(768, 1024),
    ),
)

_D, _S40, _M30 = "openb_pod_list_default", "openb_pod_list_gpushare40", "openb_pod_list_multigpu30"
_V100 = "V100M16|V100M32"
SUITE_FAMILIES: tuple[SuiteFamily, ...] = (
    SuiteFamily("q-g2-10", _D, "openb-quarter", "0.10@G2"),
    SuiteFamily("q-g2-35", _D, "openb-quarter", "0.35@G2"),
    SuiteFamily("q-t4-5", _D, "openb-quarter", "0.05@T4"),
    SuiteFamily("q-t4-10", _D, "openb-quarter", "0.10@T4"),
    SuiteFamily("q-g3-5", _D, "openb-quarter", "0.05@G3"),
    SuiteFamily("q-v100-5", _D, "openb-quarter", f"0.05@{_V100}"),
    SuiteFamily("q-v100-10", _D, "openb-quarter", f"0.10@{_V100}"),
    SuiteFamily("q-t4p100-20", _D, "openb-quarter", "0.20@T4|P100"),
    SuiteFamily("q-g2g3-20", _D, "openb-quarter", "0.20@G2|G3"),
    SuiteFamily("q-mix-20", _D, "openb-quarter", f"0.10@G2,0.05@T4,0.05@{_V100}"),
    SuiteFamily("q-mix-35", _D, "openb-quarter", f"0.15@G2,0.10@T4|P100,0.05@G3,0.05@{_V100}"),
    SuiteFamily("q-scarce-15", _D, "openb-quarter", "0.05@G3,0.05@V100M32,0.05@T4|P100"),
    SuiteFamily("q-mix-20-cpu0.5", _D, "openb-quarter", f"0.10@G2,0.05@T4,0.05@{_V100},cpu=0.5"),
    SuiteFamily("q-mix-20-cpu1.5", _D, "openb-quarter", f"0.10@G2,0.05@T4,0.05@{_V100},cpu=1.5"),
    SuiteFamily("q-t4-10-cpu2", _D, "openb-quarter", "0.10@T4,cpu=2"),
    SuiteFamily("q-cpu1.5-mem1.5", _D, "openb-quarter", "cpu=1.5,mem=1.5"),
    SuiteFamily("q-s40-mix-20", _S40, "openb-quarter", f"0.10@G2,0.05@T4,0.05@{_V100}"),
    SuiteFamily("q-s40-v100-10", _S40, "openb-quarter", f"0.10@{_V100}"),
    SuiteFamily("q-m30-mix-20", _M30, "openb-quarter", f"0.10@G2,0.05@G3,0.05@{_V100}"),
    SuiteFamily("q-m30-g3-5", _M30, "openb-quarter", "0.05@G3"),
    SuiteFamily("h-a100-10", _D, "hetero8", "0.10@A100-80G"),
    SuiteFamily("h-h800-5", _D, "hetero8", "0.05@H800"),
    SuiteFamily("h-l40-20", _D, "hetero8", "0.20@L40"),
    SuiteFamily("h-mix-30", _D, "hetero8", "0.10@A100-80G,0.10@A10|L40,0.05@H800,0.05@A10"),
    SuiteFamily("c-default", _D, "openb-cpu-quarter", "none"),
    SuiteFamily("c-mix-20", _D, "openb-cpu-quarter", f"0.10@G2,0.05@T4,0.05@{_V100}"),
)


def write_suite(traces: Path, out: Path, *, only: Sequence[str] = ()) -> list[dict[str, object]]:
    """Write :data:`SUITE_FLEETS` (``fleet_<name>.csv``) and :data:`SUITE_FAMILIES` (``gen_<name>.csv``) into
    ``out``, with ``suite.json`` describing each family (spec, realised shares, loads) and its fleet."""
    out.mkdir(parents=True, exist_ok=True)
    fleets: dict[str, list[Node]] = {}
    for fleet in SUITE_FLEETS:
        if fleet.kind == "sample":
            rows = sample_fleet(read_nodes(traces / fleet.source), fleet.fraction, seed=SUITE_SEED)
        else:
            rows = generate_fleet(
                fleet.count,
                parse_mix(fleet.mix),
                gpus=fleet.gpus,
                cpu_cores=fleet.cpu_cores,
                memory_gib=fleet.memory_gib,
                seed=SUITE_SEED,
            )
        path = out / f"fleet_{fleet.name}.csv"
        write_nodes(path, rows)
        fleets[fleet.name] = read_nodes(path)
    entries: list[dict[str, object]] = []
    for family in SUITE_FAMILIES:
        if only and family.name not in only:
            continue
        base = [p.request for p in read_pods(traces / f"{family.base}.csv")]
        pods, description = restrict_workload(
            base, fleets[family.fleet], parse_workload_spec(family.spec), seed=SUITE_SEED
        )
        write_pods(out / f"gen_{family.name}.csv", pods)
        entries.append({"family": family.name, "base": family.base, "fleet": family.fleet, **description})
    (out / "suite.json").write_text(json.dumps(entries, indent=2) + "\n")
    return entries
